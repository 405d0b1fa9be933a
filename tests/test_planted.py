"""Nothing another local user plants in /dev/shm, and nothing read from a segment, runs code or is
trusted: segments must be this user's private regular files; IPC handles are typed data."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from staleflow.servers.errors import SegmentError, ServerError
from staleflow.servers.segment import KIND_RING, Segment, segment_path
from staleflow.servers.transport import decode_cuda_handle, encode_cuda_handle


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/staleflow-pwned-shm",))


def _plant(name: str, data: bytes, mode: int) -> str:
    path = segment_path(name)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def test_a_planted_segment_with_an_open_mode_is_refused(tmp_path):
    name = f"staleflow-plant{os.getpid()}-ts-0"
    path = _plant(name, b"STLFSEG1" + b"\0" * 200, 0o644)
    try:
        with pytest.raises(SegmentError, match="mode 644, segments are created 0600"):
            Segment.attach(name, KIND_RING)
    finally:
        os.unlink(path)


def test_a_symlink_planted_under_a_segment_name_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 128)
    name = f"staleflow-link{os.getpid()}-ts-0"
    os.symlink(target, segment_path(name))
    try:
        with pytest.raises(SegmentError, match="symbolic link"):
            Segment.attach(name, KIND_RING)
    finally:
        os.unlink(segment_path(name))


def test_a_segment_of_another_user_is_refused(monkeypatch):
    seg = Segment.create(f"staleflow-uid{os.getpid()}-ts-0", 64, KIND_RING)
    try:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(segment_path(seg.name)).st_uid + 1)
        with pytest.raises(SegmentError, match="belongs to uid"):
            Segment.attach(seg.name, KIND_RING)
    finally:
        seg.close()
        seg.unlink()


def _fake_reduce_args():
    """The shape of reduce_tensor(cuda_tensor)[1] (CPU-only machines cannot make a real one)."""
    return (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        0,
        b"\x01" * 64,
        4096,
        0,
        False,
        b"ref",
        16,
        b"\x02" * 64,
        True,
    )


def test_cuda_ipc_handles_are_typed_data_not_pickles():
    args = _fake_reduce_args()
    pid, back = decode_cuda_handle(encode_cuda_handle(1234, args))
    assert pid == 1234 and back == args
    marker = "/tmp/staleflow-pwned-shm"
    if os.path.exists(marker):
        os.unlink(marker)
    with pytest.raises(ServerError, match="malformed"):
        decode_cuda_handle(pickle.dumps((1, _Payload())))
    assert not os.path.exists(marker)
