"""Packing a Ready buffer into micro-batches: pure Python on sequence lengths, no torch.

The trainer turns one staleness buffer (a list of variable-length sequences) into a *plan*:
for every trainer rank, a list of micro-batches, each a list of sequence indices packed end to
end without padding under a token budget. Steps of `plan_step`:

1. balance the sequences across ranks with Karmarkar-Karp (largest differencing) on a cost
   that models attention + MLP work, ``L + L**2 / quadratic_scale`` (Sum L^2 dominates long
   sequences, Sum L short ones), so each rank does about the same compute;
2. on each rank, pack its sequences into micro-batches with first-fit-decreasing under
   ``budget`` tokens (a sequence longer than the budget gets a micro-batch of its own: it cannot
   be split, and dropping it would lose data; the plan reports it in ``oversize``);
3. pad every rank to the same number of micro-batches with empty ones, because FSDP's
   all-gathers are collectives: every rank must run the same number of forward/backward passes.

The loss of every micro-batch is normalised by GLOBAL counts computed before the split (see
`train.losses.token_weights`), so the gradient does not depend on the plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepPlan:
    """Per rank, the micro-batches (lists of sequence indices) of one optimisation step."""

    ranks: list[list[list[int]]]
    """ranks[r][m] = sequence indices of micro-batch m on rank r (empty list = padding micro-batch)."""
    oversize: list[int] = field(default_factory=list)
    """Indices of sequences longer than the budget (each alone in its micro-batch)."""

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0


def _check_lengths(lengths: list[int]) -> None:
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"sequence length lengths[{i}]={n!r} is invalid: lengths must be ints >= 0")


def seq_cost(length: int, quadratic_scale: float = 4096.0) -> float:
    """Relative compute of one sequence: linear (MLP, LM head) plus quadratic (attention) work."""
    return length + length * length / quadratic_scale


def pack_ffd(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence indices under `budget` tokens per bin.

    Zero-length sequences are not placed (they have no tokens to train on). A sequence longer
    than the budget is placed alone. Returns bins in creation order; each bin lists indices in
    decreasing length order (ties by index), which makes the result deterministic.
    """
    _check_lengths(lengths)
    if budget < 1:
        raise ValueError(f"token budget={budget!r} is invalid: must be >= 1 (--train.micro-batch-tokens)")
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def karmarkar_karp(costs: list[float], k: int) -> list[list[int]]:
    """Split item indices into k subsets with near-equal cost sums (largest differencing method).

    Every item starts as a k-partition with the item in one subset; the two partitions with the
    largest spread are merged by pairing the heaviest subset of one with the lightest of the
    other, until one partition remains. Deterministic (ties broken by a counter).
    """
    if k < 1:
        raise ValueError(f"number of ranks k={k!r} is invalid: must be >= 1")
    if not costs:
        return [[] for _ in range(k)]
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for counter, (i, c) in enumerate(sorted(enumerate(costs), key=lambda t: (-t[1], t[0]))):
        part = [(float(c), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(c), counter, part))
    counter = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: -s[0])  # heaviest first
        b = sorted(b, key=lambda s: s[0])  # lightest first
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        spread = max(s for s, _ in merged) - min(s for s, _ in merged)
        heapq.heappush(heap, (-spread, counter, merged))
        counter += 1
    subsets = [sorted(ids) for _, ids in heap[0][2]]
    return sorted(subsets, key=lambda ids: ids[0] if ids else float("inf"))


def plan_step(lengths: list[int], num_ranks: int, budget: int, quadratic_scale: float = 4096.0) -> StepPlan:
    """The micro-batch plan of one step: balance across ranks, FFD on each, pad to equal counts."""
    _check_lengths(lengths)
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks!r} is invalid: must be >= 1")
    live = [i for i, n in enumerate(lengths) if n > 0]
    groups = karmarkar_karp([seq_cost(lengths[i], quadratic_scale) for i in live], num_ranks)
    ranks: list[list[list[int]]] = []
    for g in groups:
        ids = [live[j] for j in g]
        bins = pack_ffd([lengths[i] for i in ids], budget)
        ranks.append([[ids[j] for j in b] for b in bins])
    most = max(len(r) for r in ranks)  # 0 when nothing is trainable: every rank skips alike
    for r in ranks:
        r.extend([] for _ in range(most - len(r)))
    oversize = sorted(i for i in live if lengths[i] > budget)
    return StepPlan(ranks=ranks, oversize=oversize)
