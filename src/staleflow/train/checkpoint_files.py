"""Typed, range-checked readers of a checkpoint's JSON files (``manifest.json``, ``trainer_state.json``).

    manifest = read_manifest(Path("runs/x/checkpoints/step_00000004"))   # Manifest(version, world, files)
    state = read_trainer_state(folder, manifest.version)                  # TrainerState(...)

A checkpoint folder is input like any other: whoever can write the run folder can write it. Every
field is decoded into its type and range before anything uses it, and a bad one is one
``CheckpointError`` naming the file and the field:
  - ``version`` is an int in [0, MAX_VERSION] (the weight slots store it as int64) and equals the
    version in the folder's name (``step_00000004`` holds version 4);
  - ``files`` maps relative names to ``{"size": int >= 0, "sha256": 64 hex digits}``; a name must
    stay inside the folder: not absolute, no ``..``, no backslash or NUL, no symlink on the way;
  - ``trainer_state.json``: ``optimizer_steps`` an int in range, ``scheduler`` and ``extra`` objects.
The random-generator state of each rank (``rng_{rank}.safetensors`` + ``.json``) is written from
``rng_tensors`` and restored by ``load_rng``.
"""

from __future__ import annotations

import json
import os
import random
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from staleflow.faults import BadInput

MAX_VERSION = 2**62
"""Far beyond any run; a version past it would overflow the int64 fields it is pushed in."""
MAX_WORLD = 1 << 20
MAX_FILES = 100_000
MAX_JSON_BYTES = 256 << 20
_HEX = frozenset("0123456789abcdef")


class CheckpointError(BadInput, RuntimeError):
    """A checkpoint that is missing, partial, corrupted or crafted."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str
    node: int = 0
    """The node whose trainer rank wrote it (every node writes its own ranks' shards)."""


@dataclass(frozen=True)
class Manifest:
    version: int
    world: int
    files: dict[str, FileEntry]
    nodes: int = 1
    """Trainer nodes that wrote it (absent before 2026-12-07: 1)."""
    sharding: str = "fsdp"
    """The trainer's sharding then: fsdp, or hsdp (one state file per shard, written by the first replica)."""


@dataclass(frozen=True)
class TrainerState:
    version: int
    optimizer_steps: int
    scheduler: dict
    extra: dict


def folder_version(folder: Path) -> int | None:
    """The version in a ``step_<digits>`` folder name, or None for any other name."""
    digits = folder.name[len("step_") :] if folder.name.startswith("step_") else ""
    if not digits or not digits.isascii() or not digits.isdigit() or len(digits) > 20:
        return None
    return int(digits)


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from ``path`` (size-capped, regular file); CheckpointError naming it otherwise."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        if st.st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than a {what} can hold")
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except CheckpointError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable {what} ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: the {what} is a JSON {type(obj).__name__}, not an object")
    return obj


def _int(obj: dict, key: str, lo: int, hi: int, path: Path) -> int:
    value = obj.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise CheckpointError(f"{path}: field {key!r} is {str(value)[:40]!r}, not an integer in [{lo}, {hi}]")
    return value


def _version(obj: dict, path: Path, folder: Path) -> int:
    version = _int(obj, "version", 0, MAX_VERSION, path)
    expected = folder_version(folder)
    if version != expected:
        raise CheckpointError(f"{path}: field 'version' is {version}, but the folder {folder.name} holds {expected}")
    return version


def check_member(folder: Path, name: object, where: Path) -> Path:
    """``folder / name`` for a name that stays inside ``folder`` (no symlink on the way)."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name or len(name) > 255:
        raise CheckpointError(f"{where}: file name {str(name)[:60]!r} is not a plain relative name")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"{where}: file name {name[:60]!r} leaves the checkpoint folder")
    current = folder
    for part in parts:
        current = current / part
        if current.is_symlink():
            raise CheckpointError(f"{where}: file {name[:60]!r} is a symlink (it could point outside the folder)")
    return current


def read_manifest(folder: Path) -> Manifest:
    """``folder/manifest.json`` decoded and range-checked (the files themselves are not read)."""
    path = folder / "manifest.json"
    obj = read_json_object(path, "manifest")
    version = _version(obj, path, folder)
    world = _int(obj, "world", 1, MAX_WORLD, path)
    files = obj.get("files")
    if not isinstance(files, dict) or not files or len(files) > MAX_FILES:
        raise CheckpointError(f"{path}: field 'files' is not an object of 1 to {MAX_FILES} entries")
    out = {}
    for name, entry in files.items():
        check_member(folder, name, path)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: files[{name!r}] is a {type(entry).__name__}, not {{size, sha256}}")
        size = entry.get("size")
        if type(size) is not int or not 0 <= size < 1 << 50:
            raise CheckpointError(f"{path}: files[{name!r}].size is {str(size)[:40]!r}, not a byte count")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
            raise CheckpointError(f"{path}: files[{name!r}].sha256 is not 64 lowercase hex digits")
        node = entry.get("node", 0)
        if type(node) is not int or not 0 <= node < MAX_WORLD:
            raise CheckpointError(f"{path}: files[{name!r}].node is {str(node)[:40]!r}, not a node number")
        out[name] = FileEntry(size, digest, node)
    nodes = _int(obj, "nodes", 1, MAX_WORLD, path) if "nodes" in obj else 1
    sharding = obj.get("sharding", "fsdp")
    if sharding not in ("fsdp", "hsdp"):
        raise CheckpointError(f"{path}: field 'sharding' is {str(sharding)[:40]!r}, not fsdp or hsdp")
    return Manifest(version, world, out, nodes, sharding)


def refuse_dcp(path: Path) -> None:
    """A folder in torch's DCP format (pickled ``.metadata``) is refused, never read."""
    if (path / ".metadata").is_file() and not (path / "state.json").is_file():
        raise CheckpointError(
            f"checkpoint {path} is in torch's DCP format (written by an older StaleFlow), which "
            f"unpickles its metadata on load and is refused: start a fresh run"
        )


def read_trainer_state(folder: Path) -> TrainerState:
    """``folder/trainer_state.json`` decoded and range-checked against the folder's version."""
    path = folder / "trainer_state.json"
    obj = read_json_object(path, "trainer state")
    version = _version(obj, path, folder)
    steps = _int(obj, "optimizer_steps", 0, MAX_VERSION, path)
    for key in ("scheduler", "extra"):
        if not isinstance(obj.get(key), dict):
            raise CheckpointError(f"{path}: field {key!r} is not a JSON object")
    return TrainerState(version, steps, obj["scheduler"], obj["extra"])


def _is_int(v, lo: int = 0, hi: int = MAX_VERSION) -> bool:
    return type(v) is int and lo <= v <= hi


def check_resume_extra(extra: dict, path: Path, version: int) -> None:
    """The controller's resume state inside ``trainer_state.json`` (``extra``): each field the
    runtime reads, when present, has its type and range (runtime/job.py ``resume_state``)."""

    def bad(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{path}: field 'extra.{field}' {why}")

    if "version" in extra and extra["version"] != version:
        raise bad("version", f"is {str(extra['version'])[:40]!r}, not the checkpoint's version {version}")
    for key in ("next_traj", "next_group"):
        if key in extra and not _is_int(extra[key]):
            raise bad(key, f"is not an integer in [0, {MAX_VERSION}]")
    counts = extra.get("counts", {})
    if not isinstance(counts, dict) or not all(isinstance(k, str) and _is_int(v) for k, v in counts.items()):
        raise bad("counts", "is not an object of non-negative integer counters")
    data = extra.get("data", {})
    if not isinstance(data, dict):
        raise bad("data", "is not an object")
    for key in ("next_id", "epoch", "offset", "index", "num_rows"):
        if key in data and not _is_int(data[key]):
            raise bad(f"data.{key}", f"is not an integer in [0, {MAX_VERSION}]")
    requeue = extra.get("requeue", [])
    if not isinstance(requeue, list) or len(requeue) > MAX_FILES:
        raise bad("requeue", f"is not a list of at most {MAX_FILES} prompts")
    for i, p in enumerate(requeue):
        ok = (
            isinstance(p, dict)
            and set(p) == {"prompt_id", "text", "answer", "prompt_ids", "meta"}
            and _is_int(p["prompt_id"])
            and isinstance(p["text"], str)
            and isinstance(p["answer"], str)
            and isinstance(p["prompt_ids"], list)
            and all(_is_int(t, 0, 2**31 - 1) for t in p["prompt_ids"])
            and isinstance(p["meta"], dict)
        )
        if not ok:
            raise bad(f"requeue[{i}]", "is not a prompt {prompt_id, text, answer, prompt_ids, meta}")


def check_scheduler(saved: dict, live: dict, path: Path) -> None:
    """The LR scheduler's saved state holds the live scheduler's fields with their JSON types (torch's
    ``load_state_dict`` copies every key onto the scheduler object). A key the live one lacks is only
    accepted as a private scalar (another torch release's bookkeeping, e.g. ``_is_initial``)."""
    for key, value in saved.items():
        if key not in live:
            private = isinstance(key, str) and key.startswith("_") and not key.startswith("__")
            if not private or not (value is None or isinstance(value, (bool, int, float))):
                raise CheckpointError(
                    f"{path}: field 'scheduler.{str(key)[:40]}' is not a field of this run's scheduler"
                )
            continue
        want = live[key]
        if isinstance(want, list):
            ok = isinstance(value, list) and len(value) == len(want)
            ok = ok and all(type(a) is type(b) or (a is None) == (b is None) and a is None for a, b in zip(value, want))
        elif isinstance(want, bool):
            ok = type(value) is bool
        elif isinstance(want, int):
            ok = _is_int(value, -1)
        elif isinstance(want, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e30
        else:
            ok = value is None or type(value) is type(want)
        if not ok:
            raise CheckpointError(f"{path}: field 'scheduler.{key}' is {str(value)[:40]!r}, unlike this run's")


def rng_tensors() -> tuple[list[tuple[str, torch.Tensor]], list]:
    """This rank's generator states: tensors (torch, CUDA) and the JSON-able Python state."""
    tensors = [("torch", torch.get_rng_state())]
    if torch.cuda.is_available():
        tensors += [(f"cuda_{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    version, internal, gauss = random.getstate()
    return tensors, [version, list(internal), gauss]


def load_rng(path: Path, rank: int) -> None:
    """Restore this rank's generators from a checkpoint folder (rank 0's when it has none of its own)."""
    from safetensors.torch import load_file

    r = rank if (path / f"rng_{rank}.safetensors").is_file() else 0
    try:
        tensors = load_file(str(path / f"rng_{r}.safetensors"))
        version, internal, gauss = json.loads((path / f"rng_{r}.json").read_text())["python"]
        torch.set_rng_state(tensors["torch"])
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    except Exception as e:  # safetensors raises its own SafetensorError on a bad header
        raise CheckpointError(
            f"checkpoint {path}: unreadable random-generator state of rank {r} ({str(e).splitlines()[0][:200]})"
        ) from None
    cuda = [tensors[f"cuda_{i}"] for i in range(len(tensors)) if f"cuda_{i}" in tensors]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def reshard_note(folder: str | Path, trainer, nodes: int) -> str:
    """ "" or one line saying that the checkpoint in ``folder`` was written by another trainer layout
    (ranks, nodes, sharding) than ``trainer``'s on ``nodes`` nodes, and was resharded on load: its
    state files hold rows, and every rank reads its own rows whatever wrote them."""
    m = read_manifest(Path(folder))
    sharding = "hsdp" if getattr(trainer, "replicas", None) is not None else "fsdp"
    if (m.world, m.nodes, m.sharding) == (trainer.world, nodes, sharding):
        return ""
    return (
        f"checkpoint {Path(folder).name} was written by {m.world} trainer rank(s) on {m.nodes} node(s) "
        f"({m.sharding}); resharded onto {trainer.world} rank(s) on {nodes} node(s) ({sharding})"
    )
