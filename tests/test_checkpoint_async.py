"""Checkpoints off the critical path (train/checkpoint_writer.py): the background save writes the
same bytes as the synchronous one, returns before its writer is done while training goes on, never
overlaps another save, and a crash in the middle of its write leaves the previous checkpoint usable.
The two-rank case (every rank's part, rank 0's merge) runs under torchrun + gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import random_batch, tiny_model  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.train import checkpoint as ck  # noqa: E402
from staleflow.train import checkpoint_writer as cw  # noqa: E402
from staleflow.train.state_store import flatten_state, rank_file, write_rank_state  # noqa: E402
from staleflow.train.trainer import Trainer  # noqa: E402

CFG = dict(lr=1e-2, micro_batch_tokens=24, warmup_steps=2, schedule="cosine")


def _trainer(seed=0, group=None):
    return Trainer(tiny_model(seed=seed), TrainConfig(**CFG), total_steps=10, process_group=group)


def _held_writes(monkeypatch) -> threading.Event:
    """Every safetensors write of a checkpoint waits until the returned event is set: an injected
    slow disk, so the test sees the save while its writer is still running (no clocks involved)."""
    go, real = threading.Event(), ck.write_safetensors

    def slow(path, items, metadata=None):
        assert go.wait(120), "the test never released the writer"
        return real(path, items, metadata)

    monkeypatch.setattr(ck, "write_safetensors", slow)
    return go


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_async_save_writes_the_same_bytes_as_the_sync_save(tmp_path):
    t = _trainer()
    t.step(*random_batch(seed=1, groups=3))
    rng = torch.get_rng_state()
    sync = ck.save_checkpoint(t, tmp_path / "sync", extra={"q": [1]}, keep=1)
    torch.set_rng_state(rng)  # the generator state is part of the checkpoint
    final, writer = ck.begin_save(t, tmp_path / "async", extra={"q": [1]}, keep=1, writer=cw.CheckpointWriter())
    assert ck.finish_save(t, writer, final) == final
    assert _files(final) == _files(sync)
    # and the state file is byte for byte what the plain, unthreaded writer makes of the live state
    model_sd, optim_sd = ck._live_state(t)
    write_rank_state(tmp_path, 0, 1, flatten_state(model_sd, optim_sd)[0])
    assert (tmp_path / rank_file(0)).read_bytes() == (final / rank_file(0)).read_bytes()
    manifest = ck.verify_checkpoint(final)
    assert set(manifest["files"]) == set(_files(final)) - {ck.MANIFEST}  # no part_*.json left behind


def test_async_save_returns_before_the_writer_is_done_and_training_goes_on(tmp_path, monkeypatch):
    t = _trainer()
    t.step(*random_batch(seed=1, groups=3))
    at_save = {k: v.clone() for k, v in t.full_state_dict().items()}
    go = _held_writes(monkeypatch)
    final, writer = ck.begin_save(t, tmp_path, keep=2, writer=cw.CheckpointWriter())
    assert writer.busy and writer.poll() is None  # returned while the writer waits on the "disk"
    assert not final.exists() and (tmp_path / f".tmp-{final.name}").is_dir()
    t.step(*random_batch(seed=2, groups=3))  # training goes on and changes every weight in place
    after = t.full_state_dict()
    assert any(not torch.equal(after[k], at_save[k]) for k in at_save)
    go.set()
    ck.finish_save(t, writer, final)
    fresh = _trainer(seed=9)
    ck.load_checkpoint(fresh, final)
    assert fresh.version == 1
    got = fresh.full_state_dict()
    for k in at_save:  # the snapshot's weights, not the ones trained while it was written
        assert torch.equal(got[k], at_save[k]), k


def test_a_second_save_waits_for_the_first(tmp_path, monkeypatch):
    t = _trainer()
    go = _held_writes(monkeypatch)
    writer = cw.CheckpointWriter()
    first, _ = ck.begin_save(t, tmp_path, keep=3, writer=writer)
    t.step(*random_batch(seed=1, groups=3))
    second: list = []
    starter = threading.Thread(target=lambda: second.append(ck.begin_save(t, tmp_path, keep=3, writer=writer)))
    starter.start()
    starter.join(0.5)
    assert starter.is_alive() and not second  # blocked behind the first save's writer
    assert (tmp_path / f".tmp-{first.name}").is_dir()  # ... which it did not clear away
    go.set()
    starter.join(60)
    final, _ = second[0]
    ck.finish_save(t, writer, final)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == [first.name, final.name]
    for p in (first, final):
        ck.verify_checkpoint(p)


def _crash_mid_write(out: Path) -> None:
    """Subprocess body: one complete checkpoint, a step, then SIGKILL halfway through the next
    checkpoint's state file while training runs on."""
    t = _trainer()
    t.step(*random_batch(seed=1, groups=3))
    ck.save_checkpoint(t, out, extra={"at": 1}, keep=2)
    t.step(*random_batch(seed=2, groups=3))

    def torn(path, items, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 1000)  # part of the file is on disk
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    ck.write_safetensors = torn
    final, writer = ck.begin_save(t, out, keep=2, writer=cw.CheckpointWriter())
    t.step(*random_batch(seed=3, groups=3))
    writer.wait()


def test_a_crash_mid_write_leaves_the_previous_checkpoint_usable(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "crash", str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (tmp_path / ".tmp-step_00000002" / "rank_0.safetensors").stat().st_size == 1000  # torn
    path, warnings = ck.find_resume_checkpoint(tmp_path)
    assert path is not None and path.name == "step_00000001" and warnings == []
    fresh = _trainer(seed=5)
    assert ck.load_checkpoint(fresh, path) == {"at": 1}
    assert fresh.version == 1
    fresh.step(*random_batch(seed=2, groups=3))
    again = ck.save_checkpoint(fresh, tmp_path, keep=2)  # the resumed run's next save clears the torn folder
    assert again.name == "step_00000002" and not list(tmp_path.glob(".tmp-*"))
    ck.verify_checkpoint(again)


def test_rank_zero_waits_for_the_other_parts_within_a_limit_sized_from_its_own_write(tmp_path, monkeypatch):
    """The merge on rank 0: a part another rank failed to write is reported with that rank's
    message (a full disk as such), and a part that never comes fails after part_wait_s, not 600 s."""
    assert cw.part_wait_s(1.0) == cw.PART_WAIT_FLOOR_S
    assert cw.part_wait_s(100.0) == cw.PART_WAIT_FACTOR * 100.0
    job = cw.SaveJob(tmp_path, 0, 3, [], [], {}, write=None, sha256=None)
    part = json.dumps({"files": {"rank_1.safetensors": {"size": 1, "sha256": "x"}}})
    (tmp_path / "part_1.json").write_text(part)
    (tmp_path / "error_2.json").write_text(json.dumps({"error": "rank 2: the disk is full", "disk": True}))
    with pytest.raises(cw.DiskError, match="rank 2: the disk is full"):
        cw.CheckpointWriter._gather_parts(job, limit_s=30)
    (tmp_path / "error_2.json").unlink()
    (tmp_path / "part_1.json").write_text(part)
    with pytest.raises(cw._PartError, match=r"trainer rank\(s\) \[2\] did not finish writing within 0 s"):
        cw.CheckpointWriter._gather_parts(job, limit_s=0.05)
    (tmp_path / "part_2.json").write_text(json.dumps({"files": {"rank_2.safetensors": {"size": 2, "sha256": "y"}}}))
    (tmp_path / "part_1.json").write_text(part)
    assert sorted(cw.CheckpointWriter._gather_parts(job, limit_s=30)) == ["rank_1.safetensors", "rank_2.safetensors"]


def test_estimates_use_the_measured_write_speed():
    w = cw.CheckpointWriter()
    assert w.estimate_s(int(cw.DEFAULT_WRITE_BYTES_PER_S)) == 1.0 + cw.PART_WAIT_FLOOR_S
    w.bytes_per_s = 1e6
    assert w.estimate_s(10**9) == 1000.0 + cw.PART_WAIT_FACTOR * 1000.0


# ---- two trainer ranks (torchrun + gloo) ------------------------------------------------------------


def _two_ranks(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = _trainer(seed=3, group=dist.group.WORLD)
    t.step(*random_batch(seed=1, groups=4))
    at_save = t.full_state_dict()
    writer = cw.CheckpointWriter()
    final, _ = ck.begin_save(t, out / "ckpt", extra={"ranks": 2}, keep=2, writer=writer)
    t.step(*random_batch(seed=2, groups=4))  # trains while both ranks write
    ck.finish_save(t, writer, final)
    if rank == 1:  # a failing rank: its error reaches rank 0's merge and every rank raises
        ck.write_safetensors = lambda *a, **k: (_ for _ in ()).throw(OSError(5, "I/O error on rank 1"))
    final2, _ = ck.begin_save(t, out / "ckpt", keep=2, writer=writer)
    try:
        ck.finish_save(t, writer, final2)
        failed = ""
    except ck.CheckpointError as e:
        failed = str(e)
    if rank == 0:
        torch.save({"at_save": at_save, "failed": failed}, out / "rank0.pt")
    (out / f"failed{rank}.txt").write_text(failed)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.slow
def test_two_ranks_save_in_the_background_and_a_failed_rank_fails_the_save(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        "two",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "rank0.pt")
    assert [p.name for p in ck.list_checkpoints(tmp_path / "ckpt")] == ["step_00000001"]
    path = tmp_path / "ckpt" / "step_00000001"
    assert sorted(json.loads((path / ck.MANIFEST).read_text())["files"]) == [
        "rank_0.safetensors",
        "rank_1.safetensors",
        "rng_0.json",
        "rng_0.safetensors",
        "rng_1.json",
        "rng_1.safetensors",
        "state.json",
        "trainer_state.json",
    ]
    fresh = _trainer(seed=8)  # one rank reloads what two wrote
    assert ck.load_checkpoint(fresh, path) == {"ranks": 2}
    state = fresh.full_state_dict()
    for k, v in got["at_save"].items():
        assert torch.equal(state[k], v), k
    for r in (0, 1):  # every rank raised, with the failing rank's own message
        assert "I/O error on rank 1" in (tmp_path / f"failed{r}.txt").read_text()
    assert got["failed"] == (tmp_path / "failed0.txt").read_text()
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))  # the failed save's folder is gone


if __name__ == "__main__":
    {"crash": _crash_mid_write, "two": _two_ranks}[sys.argv[1]](Path(sys.argv[2]))


def test_the_controller_tells_a_background_saves_answers_apart(capsys):
    """The job's view of Saved messages: the answer to the save it waits for (by ticket), the late
    outcome of an earlier background save (a failure is a warning, a full disk stops the run)."""
    from staleflow.control.messages import Saved
    from staleflow.durable import DiskError
    from staleflow.runtime.job import TrainingJob

    spans = []
    job = TrainingJob.__new__(TrainingJob)  # only the checkpoint bookkeeping, no ranks
    job.run_dir, job.failure, job.saved = "/runs/x", None, None
    job.writer = type("W", (), {"log_span": lambda self, *a: spans.append(a[1])})()
    job.writing, job.waiting_ticket = (3, 10, 0.0), 4
    job._on_saved(Saved(step=10, path="/runs/x/checkpoints/step_00000010", ticket=3))  # ticket 3 is done late
    assert job.saved is None and job.writing is None and spans == ["checkpoint_write"] and job.failure is None
    job._on_saved(Saved(step=15, path="", pending=True, estimate_s=2.0, ticket=4))  # the answer being waited for
    assert job.saved.ticket == 4 and job.saved.pending
    job.waiting_ticket = None
    job._on_saved(Saved(step=15, path="", error="OSError: [Errno 5] I/O error", ticket=4))
    assert job.failure is None and "checkpoint of version 15 failed" in capsys.readouterr().err  # a warning
    job._on_saved(Saved(step=20, path="", error="DiskError: the disk is full", disk=True, ticket=5))
    assert isinstance(job.failure, DiskError) and "resume with --resume /runs/x" in str(job.failure)
