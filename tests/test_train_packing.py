"""Packing is pure: FFD under a token budget, Karmarkar-Karp balance, equal micro-batch counts per rank."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.train.packing import karmarkar_karp, pack_ffd, plan_step, seq_cost

lengths_st = st.lists(st.integers(0, 300), min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 400))
def test_ffd_places_every_nonempty_sequence_once_under_budget(lengths, budget):
    bins = pack_ffd(lengths, budget)
    placed = sorted(i for b in bins for i in b)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]
    for b in bins:
        assert b and (sum(lengths[i] for i in b) <= budget or len(b) == 1)
    # first-fit property: no two bins could be merged under the budget
    loads = [sum(lengths[i] for i in b) for b in bins]
    small = [x for x in loads if x <= budget]
    assert len(small) < 2 or sorted(small)[0] + sorted(small)[1] > budget


def test_ffd_example_and_errors():
    assert pack_ffd([5, 3, 4, 2, 6, 0], 8) == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError, match="budget=0"):
        pack_ffd([1], 0)
    with pytest.raises(ValueError, match=r"lengths\[1\]=-2"):
        pack_ffd([1, -2], 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=0, max_size=30), st.integers(1, 5))
def test_karmarkar_karp_is_a_partition_with_bounded_imbalance(costs, k):
    parts = karmarkar_karp([float(c) for c in costs], k)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    sums = [sum(costs[i] for i in p) for p in parts]
    # largest differencing never leaves a gap larger than the largest single item
    assert max(sums) - min(sums) <= max(costs, default=0)


@settings(max_examples=100, deadline=None)
@given(lengths_st, st.integers(1, 4), st.integers(16, 512))
def test_plan_covers_everything_with_equal_counts(lengths, ranks, budget):
    plan = plan_step(lengths, ranks, budget)
    assert len(plan.ranks) == ranks
    counts = {len(r) for r in plan.ranks}
    assert len(counts) == 1
    placed = sorted(i for r in plan.ranks for mb in r for i in mb)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]
    assert plan.oversize == sorted(i for i, n in enumerate(lengths) if n > budget)
    if not any(lengths):
        assert plan.micro_batches_per_rank == 0


def test_plan_balances_quadratic_cost_not_token_count():
    # Token balance would give {300,100,100,100} / {100,100,100} (600 vs 300 tokens); with the
    # quadratic term (300 costs 1200, 100 costs 200) the balanced split is {300} / {100 x 6}.
    lengths = [300] + [100] * 6
    plan = plan_step(lengths, 2, 4096, quadratic_scale=100.0)
    costs = sorted(sum(seq_cost(lengths[i], 100.0) for mb in r for i in mb) for r in plan.ranks)
    assert costs == [1200.0, 1200.0]
    assert [[0]] in plan.ranks
