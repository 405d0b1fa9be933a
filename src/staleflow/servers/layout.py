"""Flat weight layout of the Parameter Server: parameter name -> (byte offset, shape, dtype).

Built once from the policy's state dict (on the trainer leader, with full, unsharded shapes),
it travels to every rank inside control messages (a msgspec Struct) and is also stored in
each parameter-server slot, so a rollout engine can load a version in place, name by name.
Offsets are aligned (256 bytes by default) so every parameter view is aligned for any dtype.

A slot can be split into pieces (``PieceSpec``: one per trainer GPU on CUDA, one per trainer node on
CPU): a piece holds dim-0 chunks [lo, hi) of ``shards`` of every parameter, the rows FSDP2 gives those
trainer ranks (torch.chunk along dim 0: ceil(n / shards) rows per chunk), so each trainer rank writes
its shards into a piece on its own GPU (or its node's shared memory). ``piece(spec)`` is the layout of
one piece, ``split(pieces)`` that of equal pieces.

Fused groups: the rollout engine stores q|k|v and gate|up of a layer (of each expert, in a
mixture-of-experts layer) as one contiguous matrix each (``CausalLM.fuse_projections``, HF's
[out, in] orientation, members in that order). The
layout puts the members of such a group next to each other, in that order and without alignment
padding between them, so in a one-piece slot a fused matrix is one contiguous byte range laid out
exactly as the engine's: a pull copies it with one contiguous copy (``ParameterServer`` merges
copies whose source and destination are both adjacent). In piece p of a split slot the members'
rows of p are adjacent in the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import msgspec
import torch

from staleflow.shards import PieceSpec, chunk_rows, equal_pieces, piece_rows  # noqa: F401 - part of this API

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported by the parameter server: use one of {sorted(_DTYPES)}")
    return name


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype name {name!r} is not supported: use one of {sorted(_DTYPES)}") from None


_FUSED = (
    (re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$"), "qkv"),
    (re.compile(r"^(.*\.mlp(?:\.experts\.\d+)?)\.(gate|up)_proj\.(weight)$"), "gate_up"),  # dense or one expert
)
_POSITION = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


def fused_group(name: str) -> tuple[tuple[str, str, str], int] | None:
    """(group key, position in the group) of a parameter the engine fuses, else None.

    >>> fused_group("model.layers.3.self_attn.k_proj.weight")
    (('model.layers.3.self_attn', 'qkv', 'weight'), 1)
    """
    for pattern, kind in _FUSED:
        m = pattern.match(name)
        if m is not None:
            return (m.group(1), kind, m.group(3)), _POSITION[m.group(2)]
    return None


def fused_order(specs: list[tuple[str, tuple[int, ...], str]]) -> list[tuple[list, bool]]:
    """``specs`` as runs: each fused group's members together, in fused order, at the place of its
    first member (flag True: pack without padding), every other entry alone (flag False)."""
    groups: dict[tuple, list] = {}
    for spec in specs:
        g = fused_group(spec[0])
        if g is not None:
            groups.setdefault(g[0], []).append((g[1], spec))
    runs, placed = [], set()
    for spec in specs:
        g = fused_group(spec[0])
        if g is None:
            runs.append(([spec], False))
        elif g[0] not in placed:
            placed.add(g[0])
            members = [m for _, m in sorted(groups[g[0]], key=lambda x: x[0])]
            same = len({m[2] for m in members}) == 1 and len({tuple(m[1][1:]) for m in members}) == 1
            runs.append((members, same and len(members) > 1))
    return runs


class ParamEntry(msgspec.Struct, frozen=True, array_like=True):
    """One parameter in a slot: ``offset`` in bytes from the slot start, full ``shape``, ``dtype`` name."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_of(self.dtype).itemsize


class ParamLayout(msgspec.Struct, frozen=True):
    """Every parameter of a model in a fixed order, with the total slot size ``nbytes``."""

    entries: tuple[ParamEntry, ...]
    nbytes: int
    align: int = 256

    @classmethod
    def from_named_tensors(
        cls,
        named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        align: int = 256,
        dtype: torch.dtype | None = None,
    ) -> ParamLayout:
        """Layout of ``named`` (a state dict or ``model.named_parameters()``) in its order.

        ``dtype`` overrides every floating-point parameter's dtype (e.g. bfloat16 slots for fp32
        master weights); only shapes and dtypes are read, never the values.
        """
        items = list(named.items()) if isinstance(named, Mapping) else list(named)
        specs = [
            (
                name,
                tuple(int(s) for s in t.shape),
                dtype_name(dtype if dtype is not None and t.is_floating_point() else t.dtype),
            )
            for name, t in items
        ]
        if not specs:
            raise ValueError("ParamLayout.from_named_tensors got no tensors: pass a non-empty state dict")
        return cls.from_specs(specs, align)

    @classmethod
    def from_specs(cls, specs: Iterable[tuple[str, tuple[int, ...], str]], align: int = 256) -> ParamLayout:
        """Layout of (name, shape, dtype name) triples, in their order."""
        if align <= 0 or align & (align - 1):
            raise ValueError(f"ParamLayout align={align} is invalid: must be a power of two")
        specs = list(specs)
        names = [s[0] for s in specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"parameter name {dup!r} appears twice: names must be unique")
        entries, offset = [], 0
        for members, packed in fused_order(specs):
            for i, (name, shape, dt) in enumerate(members):
                e = ParamEntry(name, offset, tuple(shape), dtype_name(dtype_of(dt)))
                entries.append(e)
                offset += e.nbytes
                if not packed or i == len(members) - 1:  # the next run starts aligned
                    offset = (offset + align - 1) // align * align
        return cls(tuple(entries), offset, align)

    def split(self, pieces: int) -> list[ParamLayout]:
        """The layout of each of ``pieces`` pieces: piece p holds rows ``piece_rows(shape, pieces, p)``
        of every parameter (a shape with those rows; zero rows where a parameter has fewer rows
        than pieces). ``split(1)`` is this layout."""
        if pieces < 1:
            raise ValueError(f"split(pieces={pieces}) is invalid: need at least 1 piece")
        return [self.piece(spec) for spec in equal_pieces(pieces)]

    def piece(self, spec: PieceSpec) -> ParamLayout:
        """The layout of one piece: its rows of every parameter (this layout when it holds them all)."""
        if spec.whole:
            return self
        specs = []
        for e in self.entries:
            a, b = spec.rows(e.shape)
            shape = (b - a, *e.shape[1:]) if e.shape else (() if b > a else (0,))
            specs.append((e.name, shape, e.dtype))
        return ParamLayout.from_specs(specs, self.align)

    def piece_bytes(self, spec: PieceSpec) -> int:
        """Bytes of ``spec``'s rows of every parameter (no alignment padding: what a pull moves)."""
        total = 0
        for e in self.entries:
            a, b = spec.rows(e.shape)
            total += (b - a) * math.prod(e.shape[1:]) * dtype_of(e.dtype).itemsize
        return total

    def index(self) -> dict[str, ParamEntry]:
        """name -> entry (build once and keep)."""
        return {e.name: e for e in self.entries}

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ParamLayout:
        return msgspec.msgpack.decode(data, type=cls)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed, shaped views into a flat uint8 buffer of ``nbytes`` laid out by this layout."""
        if flat.dtype != torch.uint8 or flat.numel() < self.nbytes:
            raise ValueError(f"need a uint8 buffer of >= {self.nbytes} bytes, got {flat.dtype} x {flat.numel()}")
        return {
            e.name: flat[e.offset : e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape) for e in self.entries
        }

    def empty(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Fresh tensors with this layout's shapes and dtypes (targets for ``pull``)."""
        return {e.name: torch.empty(e.shape, dtype=dtype_of(e.dtype), device=device) for e in self.entries}
