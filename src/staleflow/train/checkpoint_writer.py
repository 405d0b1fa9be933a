"""Checkpoint writes off the training's critical path: snapshot to host memory, write in a thread.

    writer = CheckpointWriter()
    writer.start(job)          # returns once the thread runs; the job holds host copies of the state
    ...                        # training goes on: the thread writes, hashing every byte as it writes
    writer.poll()              # None while it runs, else its SaveOutcome (this rank's view)
    writer.wait()              # block until it is done

One save, on every trainer rank (train/checkpoint.py builds the job, see ``begin_save``):
 1. the previous save of this writer is waited for: saves never overlap (its host buffers are reused);
 2. ``snapshot``: this rank's rows of the model and optimizer state into one host arena of the
    state's exact size (``HostArena``: page-locked by cudaHostRegister on GPU, with asynchronous
    device-to-host copies and one CUDA event; plain copies on CPU), reused by the next save;
 3. the thread writes ``rank_{r}.safetensors`` and ``rng_{r}.*``, each hashed while it is written
    (sha256 of the bytes as they go to the file: no second read), fsyncs them, then publishes
    ``part_{r}.json`` (names, sizes, hashes; written atomically) or ``error_{r}.json`` when it failed;
 4. on rank 0 the thread then waits for every other rank's part, within a limit sized from its own
    measured write time (``part_wait_s``: the ranks write shards of the same size at the same time),
    and calls the job's ``finish`` with the merged file table (checkpoint.py writes the index, the
    trainer state and, last, the manifest, then renames the folder into place).
A crash anywhere before the rename leaves only the ``.tmp-`` folder: the previous checkpoint is the
resume point. Each rank hashes its own files in its own thread, so no rank waits while one hashes all.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from staleflow.durable import DiskError, atomic_write_json, disk_errors

PART_WAIT_FLOOR_S = 60.0
"""The least time rank 0 waits for the other ranks' parts after its own are written."""
PART_WAIT_FACTOR = 4.0
"""... else this many times its own measured write time (the others write as much, in parallel)."""

DEFAULT_WRITE_BYTES_PER_S = 200e6
"""Write speed assumed for an estimate before this rank has measured its own."""

OK, FAILED, DISK = 0, 1, 2


@dataclass
class SaveOutcome:
    code: int
    """OK, FAILED or DISK (a full, read-only or forbidden disk)."""
    error: str = ""
    path: Path | None = None
    """The checkpoint folder (rank 0, when it succeeded)."""
    bytes: int = 0
    """Bytes this rank wrote."""
    write_s: float = 0.0
    """Seconds this rank's thread took, waiting for the other ranks included."""


@dataclass
class SaveJob:
    """Everything one rank's thread needs; no live tensor of the trainer (host copies only)."""

    tmp: Path
    rank: int
    world: int
    items: list[tuple[str, torch.Tensor]]
    """This rank's (name, host tensor) of the state file."""
    rng: list[tuple[str, torch.Tensor]]
    rng_json: dict
    write: Callable[[Path, list], str]
    """Writes a safetensors file and returns its sha256 (state_store.write_safetensors)."""
    sha256: Callable[[Path], str]
    finish: Callable[[dict], Path] | None = None
    """Rank 0: given every file's {"size", "sha256"}, complete the folder and return its final path."""
    abandon: Callable[[], None] | None = None
    """Rank 0: remove the temporary folder after a failure."""
    ready: object | None = None
    """A CUDA event recorded after the device-to-host copies (None on CPU)."""
    device: torch.device | None = None
    label: str = "checkpoint"
    parts: dict = field(default_factory=dict)
    state_rank: int | None = -1
    """The state file's number (``rank_{state_rank}.safetensors``: the shard it holds; -1: ``rank``);
    None: this rank writes no state file (an HSDP replica other than the first holds the same state)."""
    node: int = 0
    """The node this rank writes from: the manifest names every file's node."""


def worst(trainer, code: int) -> int:
    """The worst outcome over the trainer ranks (a collective: every rank calls it, failed or not)."""
    if not trainer.sharded:
        return code
    import torch.distributed as dist

    flag = torch.tensor([code], dtype=torch.int32, device=trainer.device if trainer.device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=trainer.group)
    return int(flag.item())


def settle(trainer, writer: CheckpointWriter) -> None:
    """Return once every trainer rank's writer is idle (collective: every rank calls it at the same
    point, whatever its own writer is doing): a small all-reduce every 20 ms, never one long wait."""
    while worst(trainer, 1 if writer.busy else 0):
        time.sleep(0.02)


def part_wait_s(own_s: float) -> float:
    """How long rank 0 waits for the other ranks' parts once its own files are written."""
    return max(PART_WAIT_FLOOR_S, PART_WAIT_FACTOR * own_s)


ARENA_ALIGN = 64
"""Byte alignment of each tensor inside the snapshot arena (any dtype's view is aligned)."""


def _cuda_pin(buf: torch.Tensor) -> None:
    """Page-lock ``buf``'s exact bytes for DMA (cudaHostRegister): no rounding, no cached block."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))


def _cuda_unpin(buf: torch.Tensor) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))


class HostArena:
    """One host buffer of exactly the snapshot's size (each tensor at a 64-byte aligned offset),
    reused by every save of this writer while the state's shapes stay the same.

    On CUDA the buffer is page-locked by registering it (``cudaHostRegister``), not allocated with
    ``pin_memory=True``: the caching host allocator rounds every block up to a power of two and
    never returns it, so pinning tensor by tensor kept ~28-32 GiB locked per 7B trainer rank for
    ~23 GiB of state. The device-to-host copies into it are asynchronous (one CUDA event after them);
    where registering fails (a locked-memory limit, a sandbox) the arena stays pageable and the
    copies synchronous. On CPU nothing is pinned: the copies are plain."""

    def __init__(
        self, pin: Callable[[torch.Tensor], None] = _cuda_pin, unpin: Callable[[torch.Tensor], None] = _cuda_unpin
    ):
        self._pin, self._unpin = pin, unpin
        self.buf: torch.Tensor | None = None
        self.pinned = False
        self.pin_error = ""
        self.allocations = 0
        """Buffers made so far (1 for a run whose state keeps its shapes)."""

    @staticmethod
    def layout(tensors) -> tuple[list[int], int]:
        """(byte offset of each tensor, total bytes) in the arena."""
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ARENA_ALIGN) * ARENA_ALIGN
        return offsets, total

    def _reserve(self, nbytes: int, pin: bool) -> None:
        if self.buf is not None and self.buf.numel() == nbytes and (self.pinned or not pin or self.pin_error):
            return
        self.release()
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.allocations += 1
        if pin and nbytes:
            try:
                self._pin(self.buf)
                self.pinned = True
            except Exception as e:  # no page-locked memory here: pageable, synchronous copies
                self.pin_error = f"{type(e).__name__}: {e}"

    def release(self) -> None:
        """Unpin and drop the buffer (the writer's next save makes a new one)."""
        if self.buf is not None and self.pinned:
            self._unpin(self.buf)
        self.buf, self.pinned = None, False

    def snapshot(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``items`` copied into the arena: (name, host view) in the same order; asynchronous from a
        CUDA tensor when the arena is pinned (record an event after it), plain copies otherwise."""
        offsets, total = self.layout([t for _, t in items])
        cuda = any(t.is_cuda for _, t in items)
        self._reserve(total, pin=cuda)
        out = []
        for (name, t), off in zip(items, offsets):
            n = t.numel() * t.element_size()
            view = self.buf[off : off + n].view(t.dtype).view(t.shape)
            view.copy_(t.detach(), non_blocking=t.is_cuda and self.pinned)
            out.append((name, view))
        return out

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


def _file_entry(path: Path, sha: str, node: int = 0) -> dict:
    return {"size": path.stat().st_size, "sha256": sha, "node": node}


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class CheckpointWriter:
    """One background writer per trainer rank; at most one save in flight."""

    def __init__(self, copy: bool = True):
        self.copy = copy
        """Snapshot into host buffers (training may go on), or write the live tensors (the caller waits)."""
        self.buffers = HostArena()
        """The snapshot's host memory, one exact-size (pinned on CUDA) buffer reused across saves."""
        self._thread: threading.Thread | None = None
        self._outcome: SaveOutcome | None = None
        self.pending_bytes = 0
        """Bytes of this rank's state file in the save last started."""
        self.bytes_per_s = 0.0
        """This rank's measured write speed (bytes / s) of the last successful save, 0 before one."""

    def estimate_s(self, nbytes: int) -> float:
        """How long a save of ``nbytes`` per rank may take: writing at the last measured speed
        (or DEFAULT_WRITE_BYTES_PER_S) plus rank 0's limit for the other ranks' parts."""
        own = nbytes / (self.bytes_per_s or DEFAULT_WRITE_BYTES_PER_S)
        return own + part_wait_s(own)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._outcome is None

    def start(self, job: SaveJob) -> None:
        if self._thread is not None:
            raise RuntimeError("a checkpoint is still being written: wait() for it before starting another")
        self._outcome = None
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"{job.label}-writer", daemon=True)
        self._thread.start()

    def poll(self) -> SaveOutcome | None:
        """The finished save's outcome (once; the writer is then free), or None while it runs or when idle."""
        if self._thread is None or self._outcome is None:
            return None
        return self.wait()

    def wait(self, timeout_s: float | None = None) -> SaveOutcome | None:
        """Block until the save in flight is done and return its outcome (None when none was in flight)."""
        if self._thread is None:
            return None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return None
        self._thread, out = None, self._outcome
        return out

    # ---- the thread ------------------------------------------------------------------------
    def _run(self, job: SaveJob) -> None:
        t0 = time.monotonic()
        files: dict = {}
        written = 0
        try:
            if job.device is not None and job.device.type == "cuda":
                torch.cuda.set_device(job.device)  # the current device is per thread
            if job.ready is not None:
                job.ready.synchronize()  # the device-to-host copies have landed
            with disk_errors(f"writing {job.label} (rank {job.rank})", job.tmp.parent):
                state = job.rank if job.state_rank == -1 else job.state_rank
                for name, items in (
                    *(((f"rank_{state}.safetensors", job.items),) if state is not None else ()),
                    (f"rng_{job.rank}.safetensors", job.rng),
                ):
                    sha = job.write(job.tmp / name, items)
                    files[name] = _file_entry(job.tmp / name, sha, job.node)
                rng_json = job.tmp / f"rng_{job.rank}.json"
                rng_json.write_text(json.dumps(job.rng_json))
                files[rng_json.name] = _file_entry(rng_json, job.sha256(rng_json), job.node)
                for name in files:
                    _fsync(job.tmp / name)
                written = sum(e["size"] for e in files.values())
                own_s = time.monotonic() - t0
                if job.rank != 0:
                    atomic_write_json(job.tmp / f"part_{job.rank}.json", {"files": files})
                    self._done(SaveOutcome(OK, bytes=written, write_s=own_s), written, own_s)
                    return
                files.update(self._gather_parts(job, part_wait_s(own_s)))
                path = job.finish(files)
            self._done(SaveOutcome(OK, path=path, bytes=written, write_s=time.monotonic() - t0), written, own_s)
        except BaseException as e:  # noqa: BLE001 - every failure is reported to the rank, never lost
            code = DISK if isinstance(e, DiskError) else FAILED
            msg = str(e) if isinstance(e, (DiskError, _PartError)) else f"{type(e).__name__}: {e}"
            if job.rank != 0:
                try:
                    atomic_write_json(job.tmp / f"error_{job.rank}.json", {"error": msg, "disk": code == DISK})
                except OSError:
                    pass  # rank 0 then times out waiting for this rank's part, and says so
            elif job.abandon is not None:
                job.abandon()
            self._outcome = SaveOutcome(code, error=msg, bytes=written, write_s=time.monotonic() - t0)

    def _done(self, outcome: SaveOutcome, written: int, own_s: float) -> None:
        if written and own_s > 0:
            self.bytes_per_s = written / own_s
        self._outcome = outcome

    @staticmethod
    def _gather_parts(job: SaveJob, limit_s: float) -> dict:
        """Rank 0: every other rank's file table (its part_{r}.json, then removed), within limit_s."""
        files, waiting = {}, set(range(1, job.world))
        deadline = time.monotonic() + limit_s
        while waiting:
            for r in sorted(waiting):
                err = job.tmp / f"error_{r}.json"
                if err.is_file():
                    try:
                        info = json.loads(err.read_text())
                    except (OSError, ValueError):
                        info = {"error": f"rank {r} failed to write its part (its report is unreadable)", "disk": False}
                    if info.get("disk"):
                        raise DiskError(errno.ENOSPC, info.get("error", f"rank {r}: the disk is full"))
                    raise _PartError(info.get("error", f"rank {r} failed to write its part"))
                part = job.tmp / f"part_{r}.json"
                if part.is_file():
                    files.update(json.loads(part.read_text())["files"])
                    part.unlink()
                    waiting.discard(r)
            if waiting and time.monotonic() > deadline:
                raise _PartError(
                    f"{job.label}: trainer rank(s) {sorted(waiting)} did not finish writing within {limit_s:.0f} s "
                    f"(the limit is {PART_WAIT_FACTOR:g} x rank 0's own write time, at least {PART_WAIT_FLOOR_S:.0f} s)"
                )
            if waiting:
                time.sleep(0.02)
        return files


class _PartError(RuntimeError):
    """Another rank's part of a checkpoint failed or never came."""
