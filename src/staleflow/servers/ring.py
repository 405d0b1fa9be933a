"""Free-space bookkeeping of one Trajectory Server ring (pure Python, producer side only).

Records are laid out contiguously in write order, wrapping to offset 0 when the tail end of
the data region is too short (that end is skipped, never split). A record's space is
reclaimed only when it is released (the controller said "consumed" or "aborted") AND every
record written before it was released too: releases may arrive in any order, and the tail
advances over the longest released prefix. Nothing live is ever overwritten.

State: the live records in write order (generation -> [offset, size, released]) and ``head``,
the end of the newest record. With ``tail`` = offset of the oldest live record, a non-empty
ring is *unwrapped* when ``head > tail`` (free space: [head, capacity) then [0, tail)) and
*wrapped* when ``head <= tail`` (free space: [head, tail)).
"""

from __future__ import annotations

from collections import OrderedDict

from staleflow.servers.errors import RecordTooLarge, StaleHandle

RECORD_ALIGN = 64


def align_up(n: int, a: int = RECORD_ALIGN) -> int:
    return (n + a - 1) // a * a


class RingAllocator:
    """Allocate and release aligned extents of a ring of ``capacity`` bytes."""

    def __init__(self, capacity: int):
        if capacity < RECORD_ALIGN or capacity % RECORD_ALIGN:
            raise ValueError(f"ring capacity={capacity} is invalid: need a positive multiple of {RECORD_ALIGN}")
        self.capacity = capacity
        self.head = 0
        self._live: OrderedDict[int, list] = OrderedDict()  # generation -> [offset, size, released]

    def __len__(self) -> int:
        """Records not yet reclaimed (including released ones waiting behind an older live record)."""
        return len(self._live)

    @property
    def used_bytes(self) -> int:
        """Bytes held by records not yet reclaimed (the skipped end of a wrap is not counted)."""
        return sum(e[1] for e in self._live.values())

    def alloc(self, nbytes: int, generation: int) -> int | None:
        """Offset of a fresh extent for ``nbytes`` tagged ``generation``; None when full right now."""
        n = align_up(nbytes)
        if n > self.capacity:
            raise RecordTooLarge(
                f"record of {nbytes} bytes can never fit in a ring of {self.capacity} bytes: "
                f"create the ring with a larger nbytes, or split the trajectory"
            )
        if generation in self._live:
            raise ValueError(f"generation {generation} is already live in this ring")
        if not self._live:
            self.head = 0
            offset = 0
        else:
            tail = next(iter(self._live.values()))[0]
            if self.head > tail:  # unwrapped
                if self.capacity - self.head >= n:
                    offset = self.head
                elif tail >= n:
                    offset = 0
                else:
                    return None
            elif tail - self.head >= n:  # wrapped
                offset = self.head
            else:
                return None
        self._live[generation] = [offset, n, False]
        self.head = offset + n
        return offset

    def extent(self, generation: int) -> tuple[int, int] | None:
        """(offset, size) of a live, unreleased record; None otherwise."""
        e = self._live.get(generation)
        return None if e is None or e[2] else (e[0], e[1])

    def release(self, generation: int, offset: int) -> list[int]:
        """Mark a record released; return the generations whose space was reclaimed now."""
        e = self._live.get(generation)
        if e is None or e[2] or e[0] != offset:
            state = "already freed" if e is not None and e[2] else "not live in this ring"
            raise StaleHandle(
                f"record generation={generation} offset={offset} is {state}: free each handle exactly once"
            )
        e[2] = True
        reclaimed = []
        while self._live and next(iter(self._live.values()))[2]:
            reclaimed.append(self._live.popitem(last=False)[0])
        if not self._live:
            self.head = 0
        return reclaimed

    def extents(self) -> list[tuple[int, int, int, bool]]:
        """(generation, offset, size, released) of every unreclaimed record, oldest first."""
        return [(g, e[0], e[1], e[2]) for g, e in self._live.items()]
