"""Centred-rank advantages: a group's rewards replaced by their ranks, scaled to [-1/2, 1/2].

Fitness shaping from evolution strategies (Wierstra et al., "Natural Evolution Strategies", JMLR
2014; Salimans et al., "Evolution Strategies as a Scalable Alternative to Reinforcement Learning",
2017): the advantage depends only on the ORDER of the rewards in the group, so a reward of
arbitrary scale, or one outlier, moves no advantage more than its rank. Tied rewards share their
mean rank; a group whose rewards are all equal gets 0 everywhere, and every group's advantages sum
to 0, as GRPO's do.

Run on the tiny preset from the repository root:

    PYTHONPATH=$PWD ./launch.sh --preset tiny --train.advantage examples.rank_advantage:centered_rank
"""

from __future__ import annotations

from examples.calls import record


def centered_rank(rewards: list[float]) -> list[float]:
    """Advantages of one group (the interface of ``--train.advantage``: staleflow.train.advantages.AdvantageFn)."""
    record("centered_rank")
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    order = sorted(range(n), key=lambda i: rewards[i])
    ranks = [0.0] * n
    lo = 0
    while lo < n:  # a run of equal rewards [lo, hi] shares the mean rank (lo + hi) / 2
        hi = lo
        while hi + 1 < n and rewards[order[hi + 1]] == rewards[order[lo]]:
            hi += 1
        for k in range(lo, hi + 1):
            ranks[order[k]] = (lo + hi) / 2
        lo = hi + 1
    return [r / (n - 1) - 0.5 for r in ranks]
