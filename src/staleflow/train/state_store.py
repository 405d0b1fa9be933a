"""Sharded training state as safetensors + JSON: a checkpoint holds tensors and text, never code.

    index = write_rank_state(folder, rank, world, tensors)      # every rank: its own rows
    load_rank_state(folder, rank, world, targets)               # any number of ranks: their rows
    t = read_full(folder, "model/lm.model.embed_tokens.weight")  # one tensor, whole

Why not torch.distributed.checkpoint: DCP reads its ``.metadata`` with ``pickle.load`` and the
optimizer's ``param_groups`` with ``torch.load(weights_only=False)``, so a crafted checkpoint runs
code in the trainer. Here each trainer rank writes ``rank_{r}.safetensors`` (a JSON header and raw
bytes, written by our own streaming writer one tensor at a time) with its own rows of every
dim-0-sharded tensor (FSDP2's Shard(0): rank r holds rows [r*c, min((r+1)*c, n)), c = ceil(n /
world)); replicated tensors (AdamW's ``step``, unsharded runs) are written by rank 0 only. The
index (global shape, dtype, sharded or not, the world it was written with) is JSON. Loading on
W' ranks reads, for each tensor, the rows this rank keeps from whichever files hold them
(safetensors slices, no full tensor), after checking names, shapes and dtypes against the live
state: a mismatch is a one-line StateError, never a silent broadcast or cast.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch

_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class StateError(RuntimeError):
    """A state folder that does not match what is being loaded (names, shapes, dtypes, files)."""


def rank_file(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _is_sharded(t: torch.Tensor) -> bool:
    """A DTensor sharded on dim 0: FSDP2's [Shard(0)], or HSDP's [Replicate(), Shard(0)] (the rows of
    one replica); anything else is stored whole."""
    if not hasattr(t, "placements"):
        return False
    kinds = [type(p).__name__ for p in t.placements]
    if all(k == "Replicate" for k in kinds):
        return False
    if kinds[-1] != "Shard" or t.placements[-1].dim != 0 or any(k != "Replicate" for k in kinds[:-1]):
        raise StateError(
            f"a tensor with placements {t.placements} cannot be stored: only Shard(0) (FSDP2), "
            f"(Replicate, Shard(0)) (HSDP) or Replicate is supported"
        )
    return True


def row_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of an n-row tensor that ``rank`` of ``world`` holds (torch.chunk on dim 0)."""
    c = -(-n // world) if n else 0
    lo = min(rank * c, n)
    return lo, min(lo + c, n)


def write_safetensors(
    path: str | Path, items: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None
) -> str:
    """A safetensors file written tensor by tensor: only one tensor at a time is copied to the
    CPU, so a rank's whole shard never sits in host memory at once. Returns the sha256 (hex) of
    the bytes written, hashed as they are written (no second read of the file)."""
    items = list(items)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    pos = 0
    for name, t in items:
        if t.dtype not in _DTYPES:
            raise StateError(f"{name}: dtype {t.dtype} cannot be stored in safetensors here")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for block in (len(head).to_bytes(8, "little"), head):
            f.write(block)
            digest.update(block)
        for _, t in items:
            flat = t.detach().contiguous().reshape(-1).cpu()
            if flat.numel():
                view = memoryview(flat.view(torch.uint8).numpy())  # no copy: the tensor's own bytes
                f.write(view)
                digest.update(view)
        f.flush()
    return digest.hexdigest()


def rank_items(rank: int, world: int, tensors: dict[str, torch.Tensor], replica: int = 0) -> tuple[dict, list]:
    """(the index, identical on every rank; this rank's (name, local tensor) items to store):
    its rows of every dim-0-sharded tensor, and on rank 0 the replicated ones too. ``rank`` of
    ``world``: the shard this rank holds (HSDP: within its replica); only replica 0 stores anything
    (the others hold the same values)."""
    index, mine = {}, []
    for name, t in tensors.items():
        sharded = _is_sharded(t)
        if sharded:
            local = _local(t)
            lo, hi = row_range(t.shape[0], rank, world)
            if local.shape[0] != hi - lo:
                raise StateError(
                    f"{name}: rank {rank} holds {local.shape[0]} rows, torch.chunk gives {hi - lo}: "
                    f"an unexpected sharding"
                )
            if replica == 0:
                mine.append((name, local))
        elif rank == 0 and replica == 0:
            mine.append((name, _local(t)))
        index[name] = {"shape": list(t.shape), "dtype": _DTYPES.get(t.dtype, str(t.dtype)), "sharded": sharded}
    return {"world": world, "tensors": index}, mine


def write_rank_state(folder: str | Path, rank: int, world: int, tensors: dict[str, torch.Tensor]) -> dict:
    """Write this rank's part of ``tensors`` (name -> tensor or DTensor, the same names on every
    rank) into ``folder``; returns the index (identical on every rank; rank 0 saves it)."""
    index, mine = rank_items(rank, world, tensors)
    write_safetensors(Path(folder) / rank_file(rank), mine)
    return index


class _Files:
    """Open safetensors files of a state folder, each opened once (the header is JSON)."""

    def __init__(self, folder: Path):
        self.folder, self.open = folder, {}

    def whole(self, rank: int, name: str) -> torch.Tensor:
        self.slice(rank, name)  # opens the file and checks the name
        return self.open[rank].get_tensor(name)

    def slice(self, rank: int, name: str):
        from safetensors import safe_open

        if rank not in self.open:
            path = self.folder / rank_file(rank)
            try:
                self.open[rank] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types on a bad header
                raise StateError(f"{path} cannot be read as safetensors ({str(e).splitlines()[0][:200]})") from None
        try:
            return self.open[rank].get_slice(name)
        except Exception:
            raise StateError(f"{name} is missing from {self.folder / rank_file(rank)}") from None


def _rows(files: _Files, name: str, entry: dict, saved_world: int, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of a stored tensor, read from the files that hold them."""
    shape = entry["shape"]
    if not shape:
        return files.whole(0, name)
    if not entry["sharded"]:
        return files.slice(0, name)[lo:hi]
    parts = []
    for src in range(saved_world):
        a, b = row_range(shape[0], src, saved_world)
        if b <= a or b <= lo or a >= hi:
            continue
        sl = files.slice(src, name)
        if sl.get_shape() != [b - a, *shape[1:]]:
            raise StateError(
                f"{name} in {rank_file(src)} has shape {sl.get_shape()}, the index says rows [{a}, {b}) of {shape}"
            )
        parts.append(sl[max(lo, a) - a : min(hi, b) - a])
    return (
        torch.cat(parts)
        if len(parts) > 1
        else parts[0]
        if parts
        else torch.empty(0, *shape[1:], dtype=_NAMES[entry["dtype"]])
    )


def read_index(folder: str | Path) -> dict:
    path = Path(folder) / "state.json"
    try:
        index = json.loads(path.read_text())
        world = index["world"]
        if type(world) is not int or not 1 <= world <= 1 << 20 or not isinstance(index["tensors"], dict):
            raise KeyError("world/tensors")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StateError(f"{path} is missing or unreadable ({e})") from None
    for name, e in index["tensors"].items():
        ok = (
            isinstance(e, dict)
            and e.get("dtype") in _NAMES
            and isinstance(e.get("sharded"), bool)
            and isinstance(e.get("shape"), list)
            and len(e["shape"]) <= 8
            and all(type(d) is int and 0 <= d < 1 << 40 for d in e["shape"])
        )
        if not ok:
            raise StateError(f"{path}: the entry of {name} is malformed ({str(e)[:120]})")
    return index


def load_rank_state(
    folder: str | Path, rank: int, world: int, targets: dict[str, torch.Tensor], index: dict | None = None
) -> None:
    """Fill ``targets`` (name -> tensor or DTensor, in place) with this rank's rows of the stored
    state. Every target must be stored with the same global shape and dtype; a stored tensor
    that no target asks for is an error too (the checkpoint is of another model or optimizer)."""
    folder = Path(folder)
    index = index or read_index(folder)
    stored, saved_world = index["tensors"], index["world"]
    missing = sorted(set(targets) - set(stored))
    extra = sorted(set(stored) - set(targets))
    if missing or extra:
        raise StateError(
            f"the checkpoint does not match this model/optimizer: {len(missing)} tensors missing "
            f"(e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]})"
        )
    files = _Files(folder)
    with torch.no_grad():
        for name, t in targets.items():
            entry = stored[name]
            if list(t.shape) != entry["shape"] or _DTYPES.get(t.dtype) != entry["dtype"]:
                raise StateError(
                    f"{name}: stored {entry['dtype']} {entry['shape']}, this run has "
                    f"{_DTYPES.get(t.dtype, t.dtype)} {list(t.shape)}"
                )
            lo, hi = row_range(t.shape[0], rank, world) if _is_sharded(t) else (0, t.shape[0] if t.dim() else 0)
            got = _rows(files, name, entry, saved_world, lo, hi)
            dst = _local(t)
            if got.dtype != dst.dtype or list(got.shape) != list(dst.shape):
                raise StateError(
                    f"{name}: read {got.dtype} {list(got.shape)} for a local {dst.dtype} {list(dst.shape)}"
                )
            dst.copy_(got)


def read_full(folder: str | Path, name: str, index: dict | None = None) -> torch.Tensor:
    """One stored tensor, whole (every row, from every file that holds some)."""
    index = index or read_index(folder)
    entry = index["tensors"].get(name)
    if entry is None:
        raise StateError(f"{name} is not in the checkpoint {folder}")
    n = entry["shape"][0] if entry["shape"] else 0
    t = _rows(_Files(Path(folder)), name, entry, index["world"], 0, n)
    if _NAMES.get(entry["dtype"]) != t.dtype or list(t.shape) != entry["shape"]:
        raise StateError(f"{name}: read {t.dtype} {list(t.shape)}, the index says {entry['dtype']} {entry['shape']}")
    return t


def flatten_state(model_sd: dict, optim_sd: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(name -> tensor, JSON-able param groups) of torch's get_state_dict output. Names are
    ``model/<fqn>`` and ``optim/<fqn>/<state key>``; non-tensor optimizer state is refused."""
    flat = {f"model/{k}": v for k, v in model_sd.items()}
    for fqn, st in optim_sd.get("state", {}).items():
        for key, v in st.items():
            if not isinstance(v, torch.Tensor):
                v = torch.tensor(v)
            flat[f"optim/{fqn}/{key}"] = v
    groups = []
    for g in optim_sd.get("param_groups", []):
        clean = {}
        for k, v in g.items():
            if isinstance(v, tuple):
                v = list(v)
            if isinstance(v, float) and not math.isfinite(v):
                raise StateError(f"optimizer hyper-parameter {k}={v} is not finite")
            try:
                json.dumps(v)
            except TypeError:
                raise StateError(f"optimizer hyper-parameter {k} is a {type(v).__name__}, not JSON") from None
            clean[k] = v
        groups.append(clean)
    return flat, groups


def restore_groups(live: list[dict], saved: list) -> None:
    """Copy saved hyper-parameters into the live param groups (in place), after checking that the
    groups hold the same parameters; lists become tuples where the live value is a tuple."""
    if not isinstance(saved, list) or len(saved) != len(live):
        raise StateError(
            f"the checkpoint has {len(saved) if isinstance(saved, list) else '?'} optimizer param "
            f"groups, this run {len(live)}"
        )
    for g, s in zip(live, saved):
        if not isinstance(s, dict) or list(s.get("params", [])) != list(g.get("params", [])):
            raise StateError("the checkpoint's optimizer param groups hold other parameters than this run's")
        for k, v in s.items():
            if k == "params" or k not in g:
                continue
            g[k] = tuple(v) if isinstance(g[k], tuple) and isinstance(v, list) else v
