"""GPU pieces of a Parameter Server slot: one segment per (slot, piece), made by the piece's owner.

On CUDA a slot is split into pieces (``ParamLayout.split``), piece p on the GPU of trainer rank
p, allocated by that rank, so every trainer rank writes its FSDP2 shards into its own GPU's
memory (no CUDA context on another GPU) and the slots' memory is spread over the trainer GPUs
instead of doubling the leader's. Readers (rollout ranks, vLLM workers) map every piece by
CUDA IPC and copy device to device into their engine's parameters.

Segment ``staleflow-<run_id>-ps-<slot>-<piece>``, written completely before it appears
(``Segment.create(init=...)``) and never changed afterwards except its claim table:

    header   magic b"STLFPIEC", slot u32, piece u32, nbytes u64, readers u32, GPU uuid (48 B)
    claims   readers x u32: pid of the process using that reader index (0: free)
    handles  msgpack list: one serialised IPC handle per reader index (transport.py says why)

A reader claims its index under ``flock`` of the segment file; a second live process asking
for the same index is refused, and the owner's ``close`` waits (bounded) until every reader
has released its index (or died) before it drops the piece, so it never frees memory that a
reader still maps.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
import warnings

import msgspec
import torch

from staleflow.pids import pid_alive
from staleflow.servers.errors import ServerError
from staleflow.servers.layout import ParamLayout
from staleflow.servers.segment import KIND_PIECE, Segment, check_run_id, segment_path
from staleflow.servers.transport import cuda_piece_create, cuda_piece_open, cuda_piece_release

PIECE_HEADER = struct.Struct("<8sIIQI48s")  # magic, slot, piece, nbytes, readers, uuid
PIECE_MAGIC = b"STLFPIEC"


def piece_name(run_id: str, slot: int, piece: int) -> str:
    return f"staleflow-{check_run_id(run_id)}-ps-{slot}-{piece}"


class Piece:
    """One mapped piece: a flat uint8 tensor on a GPU and the typed views of its layout."""

    def __init__(self, seg: Segment, flat: torch.Tensor, layout: ParamLayout, reader: int | None, owner: bool):
        self.seg, self.flat, self.layout, self.reader, self.owner = seg, flat, layout, reader, owner
        self.views = layout.views(flat)
        self.lock_fd = os.open(segment_path(seg.name), os.O_RDWR | os.O_NOFOLLOW)  # claims work after the owner unlinks
        self.readers = PIECE_HEADER.unpack_from(seg.buf, 0)[4]

    @classmethod
    def create(
        cls, run_id: str, slot: int, piece: int, layout: ParamLayout, device: torch.device, readers: int
    ) -> Piece:
        """Allocate piece ``piece`` of ``slot`` on ``device`` (its owner) with ``readers`` handles."""
        name = piece_name(run_id, slot, piece)
        flat, blobs, uuid = cuda_piece_create(name, layout.nbytes, device, readers)
        table = msgspec.msgpack.encode(blobs)
        claims = 4 * readers

        def init(buf: memoryview) -> None:
            PIECE_HEADER.pack_into(buf, 0, PIECE_MAGIC, slot, piece, layout.nbytes, readers, uuid.encode()[:48])
            buf[PIECE_HEADER.size + claims : PIECE_HEADER.size + claims + len(table)] = table

        try:
            seg = Segment.create(name, PIECE_HEADER.size + claims + len(table), KIND_PIECE, init=init)
        except BaseException:
            cuda_piece_release(name)
            raise
        return cls(seg, flat, layout, None, owner=True)

    @classmethod
    def attach(
        cls,
        run_id: str,
        slot: int,
        piece: int,
        layout: ParamLayout,
        reader: int,
        timeout: float = 0.0,
        map_on: torch.device | None = None,
    ) -> Piece:
        """Map another rank's piece as reader index ``reader`` (claimed for this process), on the
        reader's GPU ``map_on`` where given (transport.cuda_piece_open)."""
        seg = Segment.attach(piece_name(run_id, slot, piece), KIND_PIECE, timeout)
        try:
            magic, got_slot, got_piece, nbytes, readers, uuid = PIECE_HEADER.unpack_from(seg.buf, 0)
            if magic != PIECE_MAGIC or (got_slot, got_piece) != (slot, piece) or nbytes != layout.nbytes:
                raise ServerError(f"segment {seg.name} is not piece {piece} of slot {slot} with {layout.nbytes} bytes")
            if not 0 <= reader < readers:
                raise ServerError(
                    f"reader index {reader} is outside the {readers} handles of {seg.name}: the "
                    f"creator sized it for readers 0..{readers - 1} (ParameterServer.create(readers=))"
                )
            fd = os.open(segment_path(seg.name), os.O_RDWR | os.O_NOFOLLOW)
            try:
                _claim(seg, fd, reader, os.getpid())
                try:
                    table = bytes(seg.buf[PIECE_HEADER.size + 4 * readers :])
                    blob = msgspec.msgpack.decode(table, type=list[bytes])[reader]
                    flat = cuda_piece_open(seg.name, blob, uuid.rstrip(b"\0").decode(), map_on)
                except BaseException:
                    _claim(seg, fd, reader, 0)
                    raise
            finally:
                os.close(fd)
        except BaseException:
            seg.close()
            raise
        return cls(seg, flat, layout, reader, owner=False)

    def claimed_by(self) -> list[int]:
        """Live pids holding a reader index of this piece."""
        pids = struct.unpack_from(f"<{self.readers}I", self.seg.buf, PIECE_HEADER.size) if self.readers else ()
        return [p for p in pids if p and pid_alive(p)]

    def close(self, wait_readers_s: float = 30.0) -> None:
        """Reader: drop the mapping, then release the index. Owner: wait until no live reader
        holds an index, then drop the piece and remove its segment."""
        name = self.seg.name
        self.views = self.flat = None
        if not self.owner:
            _claim(self.seg, self.lock_fd, self.reader, 0)
            os.close(self.lock_fd)
            self.seg.close()
            return
        deadline = time.monotonic() + wait_readers_s
        while (held := self.claimed_by()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if held:  # keep the memory (until this process exits) rather than free it under a reader
            warnings.warn(
                f"parameter-server piece {name}: readers {held} still map it after {wait_readers_s:.0f} s; "
                f"it stays allocated until this process exits",
                stacklevel=2,
            )
        else:
            cuda_piece_release(name)
        os.close(self.lock_fd)
        self.seg.close()
        self.seg.unlink()


def _claim(seg: Segment, fd: int, reader: int, pid: int) -> None:
    """Set reader index ``reader`` to ``pid`` (0 releases) under the lock of the segment file ``fd``."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        off = PIECE_HEADER.size + 4 * reader
        held = struct.unpack_from("<I", seg.buf, off)[0]
        if pid and held and held != pid and pid_alive(held):
            raise ServerError(
                f"reader index {reader} of {seg.name} is in use by process {held}: every process "
                f"that maps the parameter server needs its own index (attach(reader=...))"
            )
        if pid and held == pid:
            raise ServerError(
                f"reader index {reader} of {seg.name} is already attached in this process: "
                f"reuse that ParameterServer object"
            )
        struct.pack_into("<I", seg.buf, off, pid)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
