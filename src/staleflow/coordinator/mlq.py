"""Multi-level queue of the Trajectory Server (paper section 6.3).

One level per V_traj, served oldest first (strict priority: the router stops at the first level
that keeps leftovers); trajectories whose tag is not set yet (new prompts) form the last level.
Interrupted partial trajectories loop back into the level of their (unchanged) V_traj. Inside a
level the default order is longest first (prompt + generated tokens), ties by arrival.
With ``enabled=False`` it degrades to one FIFO level (the baselines' plain queue).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from staleflow.trajectory import TrajectoryItem

NEW = None
"""Level key of trajectories without a version tag."""


class MultiLevelQueue:
    """Levels keyed by V_traj (None = new), each a list sorted by (-tokens, arrival) or (arrival,)."""

    def __init__(self, enabled: bool = True, longest_first: bool = True):
        self.enabled = enabled
        self.longest_first = longest_first and enabled
        self._levels: dict[int | None, list[tuple]] = {}
        self._where: dict[int, tuple] = {}  # traj_id -> (level key, sort key)
        self._arrival: dict[int, int] = {}  # traj_id -> first arrival number (until forget())
        self._seq = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, traj_id: int) -> bool:
        return traj_id in self._where

    def push(self, item: TrajectoryItem) -> None:
        if item.traj_id in self._where:
            raise ValueError(f"trajectory {item.traj_id} is already queued; a loop-back must follow its route")
        level = item.traj_version if self.enabled else NEW
        seq = self._arrival.get(item.traj_id)
        if seq is None:  # a loop-back keeps its first arrival (FIFO: it does not go behind newer work)
            self._seq += 1
            seq = self._arrival[item.traj_id] = self._seq
        key = (-item.tokens, seq, item.traj_id) if self.longest_first else (seq, item.traj_id)
        bisect.insort(self._levels.setdefault(level, []), key + (item,))
        self._where[item.traj_id] = (level, key)

    def remove(self, traj_id: int) -> TrajectoryItem | None:
        """Take a trajectory out wherever it is (abort of a queued trajectory); None if absent."""
        where = self._where.pop(traj_id, None)
        if where is None:
            return None
        level, key = where
        lst = self._levels[level]
        i = bisect.bisect_left(lst, key)
        item = lst[i][-1]
        del lst[i]
        if not lst:
            del self._levels[level]
        return item

    def forget(self, traj_id: int) -> None:
        """The trajectory left for good (finished or aborted): drop its arrival number."""
        self._arrival.pop(traj_id, None)

    def level_keys(self) -> list[int | None]:
        """Level keys in service order: versions ascending, then new trajectories."""
        keys = sorted(k for k in self._levels if k is not None)
        if NEW in self._levels:
            keys.append(NEW)
        return keys

    def level(self, key: int | None) -> list[TrajectoryItem]:
        """Items of one level in service order (a copy; remove() what gets routed)."""
        return [e[-1] for e in self._levels.get(key, ())]

    def iter_level(self, key: int | None, limit: int) -> Iterator[TrajectoryItem]:
        """The first `limit` items of a level, in order, safe against remove() while iterating."""
        for e in self._levels.get(key, ())[:limit]:
            yield e[-1]

    def level_size(self, key: int | None) -> int:
        return len(self._levels.get(key, ()))

    def items(self) -> Iterator[TrajectoryItem]:
        for k in self.level_keys():
            yield from self.level(k)

    def oldest_version(self) -> int | None:
        """Smallest V_traj among tagged queued trajectories (None if none)."""
        keys = [k for k in self._levels if k is not None]
        if not self.enabled:
            vs = [e[-1].traj_version for e in self._levels.get(NEW, ()) if e[-1].traj_version is not None]
            return min(vs) if vs else None
        return min(keys) if keys else None
