"""What no restart fixes stops the run at once, in one line, with exit 2: non-finite or absurd
flags, an unwritable run folder, absurd rewards, a rank that failed on bad input, a full disk.
And what a crash tears is tolerated: a half-written JSONL line does not stop a resume."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from staleflow.cluster.roles import Roles
from staleflow.control.hub import FatalFailure, Hub, RankDied
from staleflow.control.messages import Failure
from staleflow.control.sockets import ControlClient, control_address
from staleflow.durable import DiskError, atomic_write_text, disk_errors, read_jsonl
from staleflow.faults import no_restart_helps
from staleflow.reward.functions import score
from staleflow.runfolder.run_dir import supersede_after
from staleflow.runfolder.scratch import remove_run_folder


def _check(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "staleflow", "check", "--preset", "tiny", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_fail_fast_check_refuses_non_finite_flags_and_an_unwritable_run_folder(tmp_path):
    r = _check("--train.lr", "inf")
    assert r.returncode == 2 and "--train.lr=inf is invalid" in r.stderr
    r = _check("--coordinator.mu", "nan")
    assert r.returncode == 2 and "--coordinator.mu=nan" in r.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = _check("--log.run-dir", str(blocker / "runs"))
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]  # (a first run may also say that it builds the model cache)
    assert last.startswith("staleflow: config error: --log.run-dir=") and "not writable (Not a directory)" in last


def test_fail_fast_absurd_rewards_are_errors_not_numbers():
    for value in (1e308, -1e7, float("inf"), float("nan")):
        reward, info = score(lambda c, a, m, v=value: v, "x", "1", {})
        assert reward == 0.0 and info["error"], value
    assert score(lambda c, a, m: 3.5, "x", "1", {})[0] == 3.5


def test_fail_fast_classifies_what_a_restart_cannot_fix():
    assert no_restart_helps(OSError(errno.ENOSPC, "No space left on device"))
    assert no_restart_helps(OSError(errno.EROFS, "Read-only file system"))
    assert no_restart_helps(FatalFailure("rank 1: ModelLoadError: bad header"))
    assert not no_restart_helps(OSError(errno.ECONNRESET, "Connection reset"))
    assert not no_restart_helps(RuntimeError("a bug"))
    with pytest.raises(DiskError, match=r"^writing x failed in /data: the disk is full; free space"):
        with disk_errors("writing x", "/data"):
            raise OSError(errno.ENOSPC, "No space left on device")
    # a file over RLIMIT_FSIZE (ulimit -f): Python ignores SIGXFSZ, the write fails EFBIG; no restart helps
    assert no_restart_helps(OSError(errno.EFBIG, "File too large"))
    with pytest.raises(DiskError, match=r"file size limit"):
        with disk_errors("writing x", "/data"):
            raise OSError(errno.EFBIG, "File too large")


def test_fail_fast_a_rank_failing_on_bad_input_stops_the_run_without_restart():
    ctl = Hub(run_id=uuid.uuid4().hex[:10], roles=Roles(3, 2), parent_pid=os.getppid())
    try:
        ctl.pids = {0: os.getpid(), 1: os.getpid(), 2: os.getpid()}
        for rank, fatal, kind in ((1, False, RankDied), (2, True, FatalFailure)):
            c = ControlClient(control_address(ctl.run_id), rank)
            c.send(Failure(rank=rank, error="ModelLoadError: model.safetensors has a corrupted header", fatal=fatal))
            c.close()
            with pytest.raises(kind, match="corrupted header"):
                ctl.recv(5.0)
    finally:
        ctl.close()
        remove_run_folder(ctl.run_id)


def test_torn_jsonl_line_is_dropped_on_resume_and_said(tmp_path):
    rows = [{"step": i, "reward_mean": 0.1 * i} for i in range(4)]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows) + '{"step": 4, "rew'
    (tmp_path / "metrics.jsonl").write_text(text)
    (tmp_path / "trained.jsonl").write_text('{"buffer": 0, "group_id": 1}\n{"buffer": 1, "gr')
    assert read_jsonl(tmp_path / "metrics.jsonl") == (rows, 1)
    notes: list[str] = []
    assert supersede_after(str(tmp_path), 3, notes) == 1
    assert len(notes) == 2 and all("torn by a crash" in n for n in notes)
    got, torn = read_jsonl(tmp_path / "metrics.jsonl")
    assert torn == 0 and [r["step"] for r in got] == [0, 1, 2, 3] and got[3]["superseded"]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")  # the next append starts a clean line
    assert read_jsonl(tmp_path / "trained.jsonl") == ([{"buffer": 0, "group_id": 1}], 0)


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "ids.json"
    atomic_write_text(path, "old")

    def boom(p: Path):
        p.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    from staleflow.durable import atomic_write

    with pytest.raises(OSError):
        atomic_write(path, boom)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["ids.json"]


def test_fail_fast_a_model_file_with_a_corrupted_header_is_one_line(tmp_path):
    """A weight file damaged at the same size (its header overwritten) is refused before any
    process starts; a rank meeting it later fails as bad input (no restart)."""
    import shutil

    from staleflow.model.hf import ModelLoadError, lazy_folder
    from staleflow.model.loader import resolve_model_path

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny-llama"), folder)
    f = folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[20:30] = b"#" * 10
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="is not a readable safetensors file") as e:
        lazy_folder(folder)
    assert no_restart_helps(e.value)
    r = _check("--model.path", str(folder))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"staleflow: {f} is not a readable")


def test_stall_sends_to_a_gone_controller_time_out_and_stats_are_dropped(tmp_path):
    """A rank whose controller is gone does not block for ever: a send gives up after its timeout
    (ControllerGone, one line), and a snapshot is dropped instead of queued without end."""
    import time

    from staleflow.control.messages import Ping
    from staleflow.control.sockets import ControllerGone
    from staleflow.coordinator.types import InstanceSnapshot

    c = ControlClient(f"ipc://{tmp_path}/nobody", 1)
    try:
        t0 = time.monotonic()
        with pytest.raises(ControllerGone, match=r"rank 1: the controller took no message for 0 s \(Ping"):
            for i in range(5000):  # ZeroMQ queues up to its high-water mark (1000), then there is no room
                c.send(Ping(rank=1, seq=i), timeout_s=0.3)
        assert 1000 <= i < 5000 and time.monotonic() - t0 < 10
        assert not c.send_stats(InstanceSnapshot(0, 0, 0, 0, 0, 1, 0.0, False, 0.0))
        assert c.stats_dropped == 1
    finally:
        c.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_fail_fast_check_refuses_cuda_graphs_without_cuda():
    """Before any process starts (the engine would refuse it only once its rank is up)."""
    r = _check("--rollout.cuda-graphs")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("staleflow: config error: --rollout.cuda-graphs needs CUDA")
