"""Multi-level queue of the Trajectory Server (paper section 6.3).

One level per V_traj, served oldest first (strict priority: the router stops at the first level
that keeps leftovers); trajectories whose tag is not set yet (new prompts) form the last level.
Interrupted partial trajectories loop back into the level of their (unchanged) V_traj. Inside a
level the default order is longest first (prompt + generated tokens), ties by arrival.
New prompts (the untagged level) keep the order they were drawn in (``new_order="drawn"``, the
default), and longest-first orders only the loop-backs; ``new_order="longest"`` orders them longest
first too (the paper code's request queue). Ordering new prompts by their length reorders the training
data: on a task whose prompt length tracks difficulty, the longest (hardest) prompts are routed, and
so trained, first while the short ones wait (docs/perf.md, issue 41).
With ``enabled=False`` it degrades to one FIFO level (the baselines' plain queue).

The queue holds trajectory ids only, inside its sort keys. Its caller (the coordinator's transition
function, coordinator/record.py) passes what the order needs when it pushes one: the V_traj it is
queued under, its tokens and its first arrival number; ``push`` returns the trajectory's place, which
the caller keeps in the trajectory's scheduling record and hands back to ``remove``. The queue keeps
no table of its own (an ordering, not a copy of the trajectory: nothing else reads these keys).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator

NEW = None
"""Level key of trajectories without a version tag."""


class MultiLevelQueue:
    """Levels keyed by V_traj (None = new), each a sorted list of (-tokens, arrival, id) or (arrival, id)."""

    def __init__(self, enabled: bool = True, longest_first: bool = True, new_order: str = "drawn"):
        if new_order not in ("longest", "drawn"):
            raise ValueError(f"MultiLevelQueue new_order={new_order!r}: 'longest' or 'drawn'")
        self.enabled = enabled
        self.longest_first = longest_first and enabled
        self.new_longest = self.longest_first and new_order == "longest"
        """New (untagged) prompts go longest first too; else in drawing order."""
        self._levels: dict[int | None, list[tuple]] = {}
        self._n = 0
        self._seq = 0
        self.tagged: Counter = Counter()
        """V_traj -> queued trajectories that carry that tag (untagged new ones are not counted)."""

    def __len__(self) -> int:
        return self._n

    def next_arrival(self) -> int:
        """A fresh arrival number (a trajectory's first push; its loop-backs reuse it)."""
        self._seq += 1
        return self._seq

    def push(self, traj_id: int, traj_version: int | None, tokens: int, arrival: int) -> tuple:
        """Queue a trajectory under V_traj ``traj_version`` (None: not tagged yet) with ``tokens`` KV tokens
        and its first ``arrival`` number; returns its place (for ``remove``)."""
        level = traj_version if self.enabled else NEW
        if not self.longest_first:
            key = (arrival, traj_id)
        elif level is NEW and not self.new_longest:  # drawing order: every key of the level has the same shape
            key = (0, arrival, traj_id)
        else:
            key = (-tokens, arrival, traj_id)
        bisect.insort(self._levels.setdefault(level, []), key)
        self._n += 1
        if traj_version is not None:
            self.tagged[traj_version] += 1
        return level, key, traj_version

    def remove(self, place: tuple) -> None:
        """Take a queued trajectory out (routed, truncated, or an abort of a queued one), by its place."""
        level, key, version = place
        lst = self._levels[level]
        del lst[bisect.bisect_left(lst, key)]
        if not lst:
            del self._levels[level]
        self._n -= 1
        if version is not None:
            self.tagged[version] -= 1
            if not self.tagged[version]:
                del self.tagged[version]

    def level_keys(self) -> list[int | None]:
        """Level keys in service order: versions ascending, then new trajectories."""
        keys = sorted(k for k in self._levels if k is not None)
        if NEW in self._levels:
            keys.append(NEW)
        return keys

    def level(self, key: int | None) -> list[int]:
        """Ids of one level in service order (a copy)."""
        return [e[-1] for e in self._levels.get(key, ())]

    def iter_level(self, key: int | None, limit: int) -> Iterator[int]:
        """The first `limit` ids of a level, in order, safe against remove() while iterating."""
        for e in self._levels.get(key, ())[:limit]:
            yield e[-1]

    def level_size(self, key: int | None) -> int:
        return len(self._levels.get(key, ()))

    def ids(self) -> Iterator[int]:
        """Every queued id, in service order."""
        for k in self.level_keys():
            yield from self.level(k)

    def oldest_version(self) -> int | None:
        """Smallest V_traj among tagged queued trajectories (None if none)."""
        return min(self.tagged) if self.tagged else None
