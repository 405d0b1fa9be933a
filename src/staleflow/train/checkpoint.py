"""Training-state checkpoints (atomic, verified, keep-last-K) and Hugging Face policy export.

    path = save_checkpoint(trainer, "runs/x/checkpoints", extra={"staleness": ...}, keep=2)
    extra = load_checkpoint(trainer, latest_checkpoint("runs/x/checkpoints"))
    export_hf(trainer, "runs/x/policy", tokenizer_from=resolve_model_path("smollm2-135m"))

A checkpoint folder ``step_{version:08d}`` holds the sharded model + optimizer state written
by torch.distributed.checkpoint (each rank writes its own shards; it reloads on any number of
ranks), ``trainer_state.json`` (version, LR scheduler, an ``extra`` dict the runtime fills: the
controller's resume state), ``rng_{rank}.pt`` (tensors and ints only: loaded with
``weights_only=True``, so a crafted file cannot run code) and, written last, ``manifest.json``
with the size and sha256 of every file. Saving steps: all ranks write into ``.tmp-step_*``; barrier;
rank 0 writes the trainer state and the manifest and renames the folder into place (an atomic
rename on one filesystem), then deletes all but the newest `keep` checkpoints. A crash leaves at
most a ``.tmp-`` folder that `latest_checkpoint` ignores; the previous checkpoint is untouched.
Loading verifies the manifest first and raises CheckpointError naming the bad file and the
previous checkpoint to fall back to; ``find_resume_checkpoint`` picks the newest intact one and
says in a warning when it had to skip a newer, damaged one (steps will be repeated).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, partial or corrupted."""


def _barrier(trainer) -> None:
    if trainer.sharded:
        dist.barrier(group=trainer.group)


@contextmanager
def _quiet_single_process(trainer):
    """DCP warns that it 'assumes a single process' when told no_dist: that is what we mean."""
    with warnings.catch_warnings():
        if not trainer.sharded:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _version_of(p: Path) -> int | None:
    try:
        return int(p.name[len(PREFIX):]) if p.name.startswith(PREFIX) else None
    except ValueError:
        return None


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
            warnings_.append(f"resuming from the older checkpoint {path.name}: steps after version "
                             f"{_version_of(path)} are trained again")
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
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({e}){hint}") from None
    for rel, info in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupted: file {rel} is missing{hint}")
        if f.stat().st_size != info["size"] or _sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupted: {rel} does not match its sha256/size{hint}")
    return manifest


def _dcp_state(trainer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.policy, trainer.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _rng_state() -> dict:
    """Tensors, ints and tuples only (weights_only=True loads it)."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(trainer, root: str | Path, extra: dict | None = None, keep: int = 2) -> Path:
    """Save the full training state of `trainer` (collective over its ranks); returns the folder."""
    import torch.distributed.checkpoint as dcp

    if keep < 1:
        raise ValueError(f"keep={keep!r} is invalid: keep at least 1 checkpoint (--checkpoint.keep)")
    root = Path(root)
    final = root / f"{PREFIX}{trainer.version:08d}"
    tmp = root / f".tmp-{final.name}"
    if trainer.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier(trainer)
    with _quiet_single_process(trainer):
        dcp.save(_dcp_state(trainer), checkpoint_id=str(tmp), process_group=trainer.group, no_dist=not trainer.sharded)
    torch.save(_rng_state(), tmp / f"rng_{trainer.rank}.pt")
    _barrier(trainer)
    if trainer.rank == 0:
        state = {"version": trainer.version, "optimizer_steps": trainer.optimizer_steps,
                 "scheduler": trainer.scheduler.state_dict(), "world": trainer.world, "extra": extra or {}}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        files = {str(f.relative_to(tmp)): {"size": f.stat().st_size, "sha256": _sha256(f)}
                 for f in sorted(tmp.rglob("*")) if f.is_file()}
        manifest = {"version": trainer.version, "world": trainer.world, "files": files}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(trainer)
    return final


def load_checkpoint(trainer, path: str | Path) -> dict:
    """Restore `trainer` from a checkpoint folder (any number of ranks); returns its `extra` dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    verify_checkpoint(path)
    state = _dcp_state(trainer)
    with _quiet_single_process(trainer):
        dcp.load(state, checkpoint_id=str(path), process_group=trainer.group, no_dist=not trainer.sharded)
    set_state_dict(trainer.policy, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    try:
        meta = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable trainer_state.json ({e})") from None
    trainer.version = meta["version"]
    trainer.optimizer_steps = meta["optimizer_steps"]
    trainer.scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / f"rng_{trainer.rank}.pt"
    rng = torch.load(rng_file if rng_file.is_file() else path / "rng_0.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return meta["extra"]


def export_hf(trainer, folder: str | Path, tokenizer_from: str | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """Write the current policy as a HF safetensors folder (collective; rank 0 writes).

    Parameters are gathered one at a time and kept (cast to ``dtype``, on the CPU) by rank 0
    only: no other rank ever holds the full fp32 model (30 GB for a 7B)."""
    from staleflow.model.hf import save_hf

    sd = trainer.full_state_dict(rank0_only=True, dtype=dtype)
    if trainer.rank == 0:
        save_hf(trainer.model, folder, tokenizer_from=tokenizer_from, state_dict=sd)
    _barrier(trainer)
    return Path(folder)


def load_policy_weights(model, path: str | Path) -> None:
    """Load only the policy weights of a checkpoint folder into an unsharded CausalLM (in place).

    For tools outside a training run (export checks, evaluation): no optimizer, no process group."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    verify_checkpoint(path)
    sd = {f"lm.{k}": v for k, v in model.state_dict().items()}  # Trainer.policy = PolicyHead(lm=model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": sd}, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict({k[len("lm."):]: v for k, v in sd.items()})
