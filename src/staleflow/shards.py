"""Which rows of each parameter a trainer rank or a Parameter Server piece holds (pure: no torch).

    piece_rows((10, 4), pieces=3, piece=2)         # (8, 10): FSDP2's rows of rank 2 of 3
    PieceSpec(owner=5, node=1, lo=4, hi=8, shards=8).rows((100, 16))   # (52, 100)

FSDP2 shards dim 0 in torch.chunk fashion: shard s of S holds rows [s*c, min((s+1)*c, n)), c = ceil(n /
S). A Parameter Server piece (servers/parameter.py, placed by cluster/placement.py) holds the chunks of
one or more consecutive shards, so its rows are one range too. The simulator reads the placement
through cluster/placement.py, so this stays free of torch.
"""

from __future__ import annotations

import msgspec


def chunk_rows(shape: tuple[int, ...], shards: int, lo: int, hi: int) -> tuple[int, int]:
    """Rows [a, b) of dim 0 in chunks [lo, hi) of ``shards`` (FSDP2's dim-0 chunking: shard s holds
    rows [s*c, min((s+1)*c, n)), c = ceil(n / shards)). A 0-dim tensor counts as one row, in chunk 0."""
    n = shape[0] if shape else 1
    c = -(-n // shards)
    return min(lo * c, n), min(hi * c, n)


def piece_rows(shape: tuple[int, ...], pieces: int, piece: int) -> tuple[int, int]:
    """Rows [a, b) of dim 0 held by ``piece`` of ``pieces`` equal pieces (one per trainer rank)."""
    return chunk_rows(shape, pieces, piece, piece + 1)


class PieceSpec(msgspec.Struct, frozen=True, array_like=True):
    """One piece of a Parameter Server slot: dim-0 chunks [lo, hi) of ``shards`` of every parameter,
    held on ``node`` and allocated, written (on GPU) and served to other nodes by rank ``owner``.

    FSDP over W trainer ranks: shards = W, a GPU piece per rank (chunk r), a CPU piece per node (its
    ranks' chunks). HSDP (shard within a node, replicate across nodes): shards = ranks per node, and
    every trainer node holds every chunk: pieces with the same (lo, hi) are replicas (cluster/placement.py)."""

    owner: int
    node: int
    lo: int
    hi: int
    shards: int

    def rows(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return chunk_rows(shape, self.shards, self.lo, self.hi)

    @property
    def whole(self) -> bool:
        """Every row of every parameter."""
        return self.lo == 0 and self.hi == self.shards


def equal_pieces(pieces: int) -> tuple[PieceSpec, ...]:
    """``pieces`` pieces on one node, piece p owned by rank p (a single-node run's table)."""
    return tuple(PieceSpec(p, 0, p, p + 1, pieces) for p in range(pieces))
