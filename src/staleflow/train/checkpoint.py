"""Training-state checkpoints (atomic, verified, keep-last-K) and Hugging Face policy export.

    path = save_checkpoint(trainer, "runs/x/checkpoints", extra={"staleness": ...}, keep=2)
    final, writer = begin_save(trainer, root, extra, keep, writer, node=1, nodes=2)   # returns after the snapshot
    finish_save(trainer, writer, final)                              # collective wait, raises on failure
    extra = load_checkpoint(trainer, latest_checkpoint("runs/x/checkpoints"))
    export_hf(trainer, "runs/x/policy", tokenizer_from=resolve_model_path("smollm2-135m"))

A checkpoint folder ``step_{version:08d}`` holds the sharded model + optimizer state as
safetensors written by every trainer rank (``rank_{r}.safetensors``: its own rows; it reloads on
any number of ranks) with a JSON index ``state.json`` (shapes, dtypes, the optimizer's param
groups; train/state_store.py), ``trainer_state.json`` (version, LR scheduler, an ``extra`` dict
the runtime fills: the controller's resume state), ``rng_{rank}.safetensors`` + ``rng_{rank}.json``
and, written last, ``manifest.json`` with the size, sha256 and writing node of every file (and the
number of trainer nodes and the sharding that wrote it: with HSDP only the first replica writes the
state, one file per shard; a resume on another number of nodes reshards it). Nothing in a
checkpoint is unpickled or executed: safetensors headers and JSON only (torch's DCP format, which
unpickles its metadata, is refused with a one-line error). Saving (``begin_save`` then
``finish_save``; ``save_checkpoint`` does both): rank 0 makes ``.tmp-step_*`` and every rank agrees;
each rank copies its state into host memory and hands it to its background writer
(train/checkpoint_writer.py), which writes and hashes its own files in parallel with the other
ranks and with training; rank 0's writer waits for every rank's part (a limit sized from its own
write time), writes the index, the trainer state and the manifest, renames the folder into place
(atomic on one filesystem, then the directory is fsynced) and deletes all but the newest `keep`.
A second save waits for the first. A failed save (disk full: named as such) removes its temporary
folder at once; a crash leaves at most a ``.tmp-`` folder that `latest_checkpoint` ignores and the
next save removes; the previous checkpoint is untouched.
Loading verifies the manifest first and raises CheckpointError naming the bad file and the
previous checkpoint to fall back to; ``find_resume_checkpoint`` picks the newest intact one and
says in a warning when it had to skip a newer, damaged one (steps will be repeated).
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from staleflow.durable import DiskError, atomic_write_json, disk_errors, file_sha256, fsync_dir
from staleflow.train.checkpoint_files import (
    CheckpointError,
    check_resume_extra,
    check_scheduler,
    folder_version,
    load_rng,
    read_manifest,
    read_trainer_state,
    refuse_dcp,
    rng_tensors,
)
from staleflow.train.checkpoint_writer import DISK as _DISK
from staleflow.train.checkpoint_writer import FAILED as _FAILED
from staleflow.train.checkpoint_writer import OK as _OK
from staleflow.train.checkpoint_writer import CheckpointWriter, SaveJob, settle
from staleflow.train.checkpoint_writer import worst as _worst
from staleflow.train.export import export_hf  # noqa: F401 - part of this module's API
from staleflow.train.state_store import (
    StateError,
    flatten_state,
    load_rank_state,
    rank_items,
    read_full,
    read_index,
    restore_groups,
    write_safetensors,
)

MANIFEST = "manifest.json"
PREFIX = "step_"
HASH_THREADS = 8
"""Files hashed at once when a checkpoint is verified (one thread per file)."""


class CheckpointDiskError(CheckpointError):
    """A save failed because the disk is full, read-only or not permitted: no retry fixes it."""


_sha256 = file_sha256  # a module-level name: tests replace it to kill a save midway


def _version_of(p: Path) -> int | None:
    return folder_version(p)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete (manifest present) checkpoint folders under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _version_of(p) is not None and (p / MANIFEST).is_file()]
    return sorted(found, key=_version_of)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint folder under root, or None (partial .tmp- folders are ignored)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def find_resume_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and a warning for every newer one that did not.

    A ``step_*`` folder without its manifest (deleted, or a crash after the rename on a foreign
    file system) or whose files do not match it is skipped loudly: resuming from an older
    checkpoint repeats steps, and the user must know."""
    root = Path(root)
    if not root.is_dir():
        return None, []
    folders = sorted((p for p in root.iterdir() if p.is_dir() and _version_of(p) is not None), key=_version_of)
    warnings_: list[str] = []
    for path in reversed(folders):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            warnings_.append(f"skipping checkpoint {path.name}: {str(e).split('; the previous')[0]}")
            continue
        if warnings_:
            warnings_.append(
                f"resuming from the older checkpoint {path.name}: steps after version "
                f"{_version_of(path)} are trained again"
            )
        return path, warnings_
    return None, warnings_


def verify_checkpoint(path: str | Path) -> dict:
    """Check every file against the manifest; return the manifest or raise CheckpointError."""
    path = Path(path)
    prev = [p for p in list_checkpoints(path.parent) if _version_of(p) < (_version_of(path) or 0)]
    hint = f"; the previous checkpoint {prev[-1]} is intact: resume from it" if prev else ""
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {path} is partial or missing (no {MANIFEST}){hint}")
    try:
        manifest = read_manifest(path)  # typed: every name inside the folder, sizes and digests well formed
        state = read_trainer_state(path)
        check_resume_extra(state.extra, path / "trainer_state.json", state.version)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path} is invalid: {e}{hint}") from None
    files = manifest.files
    for rel, info in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupted: file {rel} is missing{hint}")
        if f.stat().st_size != info.size:
            raise CheckpointError(f"checkpoint {path} is corrupted: {rel} does not match its sha256/size{hint}")
    if "trainer_state.json" not in files:
        raise CheckpointError(f"checkpoint {path} is invalid: its manifest does not cover trainer_state.json{hint}")
    rels = list(files)
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(rels)))) as pool:  # hashlib frees the GIL
        digests = list(pool.map(lambda rel: _sha256(path / rel), rels))
    for rel, digest in zip(rels, digests):
        if digest != files[rel].sha256:
            raise CheckpointError(f"checkpoint {path} is corrupted: {rel} does not match its sha256/size{hint}")
    return {
        "version": manifest.version,
        "world": manifest.world,
        "nodes": manifest.nodes,
        "sharding": manifest.sharding,
        "files": {k: {"size": v.size, "sha256": v.sha256, "node": v.node} for k, v in files.items()},
    }


def _options(trainer):
    """A LoRA trainer's checkpoint holds its adapters (and their AdamW state) only: the frozen base
    weights are --model.path's, unchanged, and are left out (``ignore_frozen_params``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = getattr(trainer, "lora", None) is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _live_state(trainer) -> tuple[dict, dict]:
    """torch's (model, optimizer) state dicts of the trainer: DTensor shards when sharded (the
    optimizer's state is created here if no step ran yet, so every name exists)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(trainer.policy, trainer.optimizer, options=_options(trainer))


def _outcome(e: BaseException | None) -> int:
    return _OK if e is None else _DISK if isinstance(e, DiskError) else _FAILED


def _raise(code: int, error: BaseException | str | None, otherwise: str) -> None:
    if code == _OK:
        return
    msg = str(error) if error else otherwise
    if code == _DISK:
        raise CheckpointDiskError(
            msg
            if error
            else f"{otherwise} (a disk problem on another rank: the disk is full, read-only or not permitted)"
        )
    raise CheckpointError(msg)


def begin_save(
    trainer,
    root: str | Path,
    extra: dict | None = None,
    keep: int = 2,
    writer: CheckpointWriter | None = None,
    node: int = 0,
    nodes: int = 1,
) -> tuple[Path, CheckpointWriter]:
    """Start saving the full training state of ``trainer`` (collective over its ranks): wait for
    ``writer``'s previous save, make the temporary folder, snapshot the state into host memory and
    hand it to the writer's thread. Returns (the checkpoint's final path, the writer) as soon as the
    thread runs: the trainer may change its state from then on. ``finish_save`` waits for it.
    ``node`` / ``nodes``: this rank's node and the trainer's node count (the manifest names them; the
    folder must be on a file system every trainer node shares)."""
    if keep < 1:
        raise ValueError(f"keep={keep!r} is invalid: keep at least 1 checkpoint (--checkpoint.keep)")
    writer = writer or CheckpointWriter()
    writer.wait()  # saves never overlap: the previous one (and its use of the host buffers) is done
    root = Path(root)
    final = root / f"{PREFIX}{trainer.version:08d}"
    tmp = root / f".tmp-{final.name}"
    error: BaseException | None = None
    if trainer.rank == 0:
        try:
            with disk_errors(f"creating {tmp}", root):
                root.mkdir(parents=True, exist_ok=True)
                for stale in root.glob(".tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
        except OSError as e:
            error = e
    _raise(_worst(trainer, _outcome(error)), error, f"checkpoint {final.name}: the leader could not create {tmp}")
    try:
        job = _snapshot(trainer, tmp, final, extra, keep, writer.buffers if writer.copy else None, node, nodes)
    except Exception as e:  # StateError, or no host memory for the copy: every rank must hear of it
        error = e
    code = _worst(trainer, _outcome(error))
    if code != _OK and trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise(code, error, f"checkpoint {final.name}: another trainer rank could not snapshot its state")
    writer.pending_bytes = sum(t.numel() * t.element_size() for _, t in job.items)
    writer.start(job)
    return final, writer


def finish_save(trainer, writer: CheckpointWriter, final: Path) -> Path:
    """Wait (collectively) until every rank's part of the save begun by ``begin_save`` is written and
    rank 0 has put the folder into place; raise CheckpointError on every rank if any rank failed.

    No rank blocks in one long collective: the ranks poll together (a small all-reduce every 20 ms)
    until every writer thread is done, so the only limit is rank 0's wait for the others' parts,
    sized from its own measured write time (checkpoint_writer.part_wait_s), not a fixed timeout."""
    settle(trainer, writer)
    outcome = writer.wait()
    code = outcome.code if outcome is not None else _FAILED
    _raise(
        _worst(trainer, code),
        outcome.error if outcome is not None and code != _OK else None,
        f"checkpoint {final.name}: another trainer rank failed to write its part; the previous "
        f"checkpoint stays the resume point",
    )
    return final


def save_checkpoint(trainer, root: str | Path, extra: dict | None = None, keep: int = 2) -> Path:
    """Save the full training state of `trainer` (collective over its ranks) and wait until it is in
    place; returns the folder.

    Raises CheckpointError (every rank) when any rank failed to write; the temporary folder is
    removed at once and the previous checkpoint stays the resume point."""
    final, writer = begin_save(trainer, root, extra, keep, CheckpointWriter(copy=False))
    return finish_save(trainer, writer, final)


def _snapshot(
    trainer, tmp: Path, final: Path, extra: dict | None, keep: int, buffers, node: int = 0, nodes: int = 1
) -> SaveJob:
    """This rank's state copied into host buffers (the writer's own, reused), and the job that writes it."""
    model_sd, optim_sd = _live_state(trainer)
    flat, groups = flatten_state(model_sd, optim_sd)
    replica = getattr(trainer, "replica", 0)
    shard, shards = getattr(trainer, "shard_rank", trainer.rank), getattr(trainer, "shard_world", trainer.world)
    index, mine = rank_items(shard, shards, flat, replica)
    index["param_groups"] = groups
    copy = buffers is not None
    cuda = any(t.is_cuda for _, t in mine)
    items = buffers.snapshot(list(mine)) if copy else list(mine)  # one exact-size host arena (HostArena)
    ready = None
    if copy and cuda:
        ready = torch.cuda.Event()
        ready.record()
    rng, py_state = rng_tensors()
    job = SaveJob(
        tmp=tmp,
        rank=trainer.rank,
        world=trainer.world,
        items=items,
        rng=rng,
        rng_json={"python": py_state},
        write=lambda path, items: write_safetensors(path, items),  # looked up at call time: tests replace it
        sha256=lambda path: _sha256(path),
        ready=ready,
        device=trainer.device,
        label=f"checkpoint {final.name}",
        state_rank=shard if replica == 0 else None,
        node=node,
    )
    if trainer.rank == 0:
        state = {
            "version": trainer.version,
            "optimizer_steps": trainer.optimizer_steps,
            "scheduler": json.loads(json.dumps(trainer.scheduler.state_dict())),
            "world": trainer.world,
            "extra": extra or {},
        }
        spread = {"nodes": nodes, "sharding": "hsdp" if getattr(trainer, "replicas", None) is not None else "fsdp"}
        job.finish = lambda files: _finish(tmp, final, index, state, files, keep, spread)
        job.abandon = lambda: shutil.rmtree(tmp, ignore_errors=True)
    return job


def _finish(tmp: Path, final: Path, index: dict, state: dict, files: dict, keep: int, spread: dict) -> Path:
    """Rank 0's thread, once every rank's files are written: index, trainer state and manifest
    (last, with ``spread``: the trainer's nodes and sharding), then the atomic rename into place and
    the pruning of old checkpoints."""
    for name, obj in (("state.json", index), ("trainer_state.json", state)):
        atomic_write_json(tmp / name, obj)
        files[name] = {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name), "node": 0}
    manifest = {"version": state["version"], "world": state["world"], **spread, "files": dict(sorted(files.items()))}
    atomic_write_json(tmp / MANIFEST, manifest, indent=1)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for old in list_checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(trainer, path: str | Path) -> dict:
    """Restore `trainer` from a checkpoint folder (any number of ranks); returns its `extra` dict."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    verify_checkpoint(path)
    refuse_dcp(path)
    model_sd, optim_sd = _live_state(trainer)
    flat, _ = flatten_state(model_sd, optim_sd)
    try:
        index = read_index(path)
        shard, shards = getattr(trainer, "shard_rank", trainer.rank), getattr(trainer, "shard_world", trainer.world)
        load_rank_state(path, shard, shards, flat, index)  # any layout: each rank reads its rows
        restore_groups(optim_sd["param_groups"], index.get("param_groups"))
        for fqn, st in optim_sd.get("state", {}).items():  # scalars came back as tensors: give the type back
            for key, v in list(st.items()):
                if not isinstance(v, torch.Tensor):
                    st[key] = type(v)(flat[f"optim/{fqn}/{key}"].item())
    except StateError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    set_state_dict(
        trainer.policy,
        trainer.optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=_options(trainer),
    )
    meta = read_trainer_state(path)  # verified above; typed and range-checked here
    trainer.version, trainer.optimizer_steps = meta.version, meta.optimizer_steps
    check_scheduler(meta.scheduler, trainer.scheduler.state_dict(), path / "trainer_state.json")
    try:
        trainer.scheduler.load_state_dict(meta.scheduler)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: trainer_state.json field 'scheduler' does not fit ({e})") from None
    extra = meta.extra
    load_rng(path, trainer.rank)
    return extra


def load_policy_weights(model, path: str | Path) -> None:
    """Load only the policy weights of a checkpoint folder into an unsharded CausalLM (in place).

    For tools outside a training run (export checks, evaluation): no optimizer, no process group."""
    path = Path(path)
    verify_checkpoint(path)
    refuse_dcp(path)
    try:
        index = read_index(path)
        sd = {}
        for k, v in model.state_dict().items():  # Trainer.policy = PolicyHead(lm=model)
            t = read_full(path, f"model/lm.{k}", index)
            if t.shape != v.shape:
                raise StateError(f"model/lm.{k}: stored {list(t.shape)}, the model has {list(v.shape)}")
            sd[k] = t.to(v.dtype)
    except StateError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    model.load_state_dict(sd)
