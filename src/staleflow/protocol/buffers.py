"""The staleness buffers: StaleFlow's reservation book (pure Python).

One buffer per version v (created lazily), ``capacity`` entries (B'), Ready once ``batch_size`` (B)
entries are OCCUPIED. An entry holds one prompt group's id, RESERVED (in flight) or OCCUPIED
(generated and rewarded). The book knows entries and room, nothing about windows or versions:
the rules that decide which buffer a group may take (reserve, occupy, the exchange, consume) are
the StalenessManager's (protocol/staleness.py).

    book = BufferBook(batch_size=2, capacity=3)
    book.reserve("g0", 1); book.occupy("g0", 1, 0)   # g0 moves from its reservation in 1 to buffer 0
"""

from __future__ import annotations

from staleflow.protocol.types import BufferState, EntryState


class Buffer:
    __slots__ = ("reserved", "occupied")

    def __init__(self):
        self.reserved: dict = {}  # group_id -> None (ordered set of RESERVED entries)
        self.occupied: list = []  # group ids of OCCUPIED entries, in occupation order


class BufferBook:
    def __init__(self, batch_size: int, capacity: int):
        self.batch_size, self.capacity = batch_size, capacity
        self.buffers: dict[int, Buffer] = {}
        self.full: set[int] = set()
        """Buffers with no room: Ready, or no EMPTY entry left."""

    # ---- queries -------------------------------------------------------------------------------
    def get(self, v: int) -> Buffer | None:
        return self.buffers.get(v)

    def latest_room(self, lo: int, hi: int, skip: int | None = None) -> int | None:
        """The latest buffer in [lo, hi] (other than ``skip``) with a free required slot and an EMPTY entry."""
        full = self.full
        for v in range(hi, lo - 1, -1):
            if v not in full and v != skip:
                return v
        return None

    def is_ready(self, v: int) -> bool:
        b = self.buffers.get(v)
        return b is not None and len(b.occupied) >= self.batch_size

    def state(self, v: int) -> BufferState:
        b = self.buffers.get(v)
        if b is None:
            return BufferState.WAITING
        if len(b.occupied) >= self.batch_size:
            return BufferState.READY
        return BufferState.STUCK if len(b.occupied) + len(b.reserved) >= self.capacity else BufferState.WAITING

    def entries(self, v: int) -> dict:
        b = self.buffers.get(v) or Buffer()
        n_res, n_occ = len(b.reserved), len(b.occupied)
        return {EntryState.EMPTY: self.capacity - n_res - n_occ, EntryState.RESERVED: n_res, EntryState.OCCUPIED: n_occ}

    # ---- entries -------------------------------------------------------------------------------
    def _buf(self, v: int) -> Buffer:
        b = self.buffers.get(v)
        if b is None:
            b = self.buffers[v] = Buffer()
        return b

    def refresh(self, v: int) -> None:
        """Recompute whether buffer v has room (a free required slot and an EMPTY entry)."""
        b = self.buffers.get(v)
        if b is None or (len(b.occupied) < self.batch_size and len(b.occupied) + len(b.reserved) < self.capacity):
            self.full.discard(v)
        else:
            self.full.add(v)

    def reserve(self, group_id, v: int) -> None:
        b = self._buf(v)
        b.reserved[group_id] = None
        if len(b.reserved) + len(b.occupied) >= self.capacity:
            self.full.add(v)

    def move(self, group_id, src: int, dst: int) -> None:
        """A reservation changes buffer (the occupy exchange, a Ready buffer's surplus)."""
        del self.buffers[src].reserved[group_id]
        self._buf(dst).reserved[group_id] = None
        self.refresh(src)
        self.refresh(dst)

    def release(self, group_id, v: int) -> None:
        """Drop a reservation (the group occupies elsewhere or is aborted); never in a Ready buffer."""
        del self.buffers[v].reserved[group_id]
        self.refresh(v)

    def occupy(self, group_id, v: int) -> bool:
        """An OCCUPIED entry for the group in buffer v; True when v thereby became Ready."""
        b = self._buf(v)
        b.occupied.append(group_id)
        if len(b.occupied) == self.batch_size:
            self.full.add(v)
            return True
        if len(b.occupied) + len(b.reserved) >= self.capacity:
            self.full.add(v)
        return False

    def take_reserved(self, v: int) -> list:
        """Empty buffer v's reservations (it became Ready: they must live elsewhere); returns their groups."""
        b = self.buffers[v]
        gids, b.reserved = list(b.reserved), {}
        return gids

    def pop(self, v: int) -> list:
        """Free buffer v (consumed); returns its occupied group ids."""
        b = self.buffers.pop(v)
        self.full.discard(v)
        assert not b.reserved, "a Ready buffer holds no reservations"
        return list(b.occupied)

    # ---- checkpoint and self-check -------------------------------------------------------------
    def state_list(self) -> list:
        return [
            {"version": v, "reserved": list(b.reserved), "occupied": list(b.occupied)}
            for v, b in sorted(self.buffers.items())
        ]

    def load(self, records: list) -> None:
        for rec in records:
            b = self.buffers[rec["version"]] = Buffer()
            b.reserved = dict.fromkeys(rec["reserved"])
            b.occupied = list(rec["occupied"])
            self.refresh(rec["version"])

    def check(self, fail) -> None:
        """Capacity and the room index, recomputed from the entries."""
        for v, b in self.buffers.items():
            if len(b.occupied) != len(set(b.occupied)):
                fail(f"buffer {v} lists a group twice")
            if len(b.occupied) > self.batch_size or len(b.occupied) + len(b.reserved) > self.capacity:
                fail(f"buffer {v} over capacity ({len(b.occupied)} occupied, {len(b.reserved)} reserved)")
            if len(b.occupied) == self.batch_size and b.reserved:
                fail(f"Ready buffer {v} still holds reservations")
        for v in set(self.buffers) | self.full:
            b = self.buffers.get(v)
            full = b is not None and (
                len(b.occupied) >= self.batch_size or len(b.occupied) + len(b.reserved) >= self.capacity
            )
            if full != (v in self.full):
                fail(f"buffer {v} room index is stale ({'full' if full else 'has room'})")
