"""Train order "drawn": the buffer being consumed takes the earliest-started completed groups (pure Python).

With ``train_order="drawn"`` (``--staleness.train-order drawn``) the StalenessManager calls
``reorder(m, v)`` just before it consumes buffer v. Greedy Occupy fills each buffer with the groups
that COMPLETED first; here v's occupied groups are exchanged, one for one, with occupied groups of
later buffers w in (v, v + eta] that STARTED earlier (``m._seq``: the order of each group's first
reserve, the admission number AReaL's batch rule sorts by), as long as both stay in their windows:

- Y (in w) may come into v iff V_Y <= v (v < w <= V_Y + eta bounds it above);
- X (in v) may go to w iff w <= V_X + eta (V_X <= v < w bounds it below).

Every swap lowers the sum of v's start numbers, so the loop ends; it ends when no legal swap would
put an earlier-started group into v. Occupied counts do not change (no buffer gains or loses
Readiness), reservations are not touched, and only occupied groups move.
"""

from __future__ import annotations


def reorder(m, v: int) -> int:
    """Swap buffer v's occupied groups with earlier-started occupied groups of later buffers; returns the swaps."""
    book, groups, seq, eta = m.book, m._groups, m._seq, m.eta
    mine = book.buffers[v].occupied
    swaps = 0
    while True:  # passes over the eligible later groups, earliest-started first, until one swaps nothing
        later = sorted(
            (seq[y], w, y)
            for w in range(v + 1, v + eta + 1)
            if (b := book.buffers.get(w)) is not None
            for y in b.occupied
            if groups[y].traj_version <= v
        )
        before = swaps
        for s_y, w, y in later:
            # the latest-started group of v that started after Y and may live in w
            best, best_seq = None, s_y
            for x in mine:
                if seq[x] > best_seq and w <= groups[x].traj_version + eta:
                    best, best_seq = x, seq[x]
            if best is None:
                continue
            theirs = book.buffers[w].occupied
            mine[mine.index(best)] = y
            theirs[theirs.index(y)] = best
            groups[y].buffer, groups[best].buffer = v, w
            swaps += 1
        if swaps == before:
            return swaps
