"""Scheduler + BlockManager without a model: a pure-Python driver plays the engine's part
(advance num_computed, append a token when a sequence's feed completes) while hypothesis
draws arrivals, aborts and cache sizes. Invariants checked after every step: blocks are owned
by at most one sequence and none is lost, block tables cover the cached tokens, the running
cap and the prefill budget hold, every request finishes, and the cache ends empty."""

from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.rollout.block_manager import BlockManager
from staleflow.rollout.engine import Request, SamplingParams
from staleflow.rollout.scheduler import Scheduler
from staleflow.rollout.sequence import Sequence, SequenceStatus


def make_seq(i, prompt_len, max_new):
    return Sequence(Request(i, [5] * prompt_len, SamplingParams(max_new_tokens=max_new), seed=i), arrival=i)


def check_invariants(sch: Scheduler, live: list[Sequence]):
    bm = sch.block_manager
    owned = [b for s in live for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block has two owners"
    assert sorted(owned + bm.free_blocks) == list(range(bm.num_blocks)), "a block was lost or duplicated"
    for s in live:
        assert len(s.block_table) * bm.block_size >= s.num_computed
        if s.status is SequenceStatus.WAITING:
            assert s.num_computed == 0 and not s.block_table
    assert len(sch.running) <= sch.max_running


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(6, 24),
    block_size=st.sampled_from([1, 2, 4]),
    max_running=st.integers(1, 5),
    budget=st.integers(1, 12),
    reqs=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 8)), min_size=1, max_size=10),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), max_size=4),
)
def test_scheduler_invariants_and_progress(num_blocks, block_size, max_running, budget, reqs, aborts):
    bm = BlockManager(num_blocks, block_size)
    max_len = num_blocks * block_size  # the engine guarantees a lone sequence fits
    sch = Scheduler(bm, max_running, budget)
    live, done = [], set()
    for i, (plen, new) in enumerate(reqs):
        plen = min(plen, max_len - 1)
        seq = make_seq(i, plen, new)
        sch.add(seq)
        live.append(seq)
    abort_at = {}
    for step, idx in aborts:
        abort_at.setdefault(step, []).append(idx)
    for step in range(2000):
        if not sch.has_unfinished():
            break
        for idx in abort_at.get(step, []):
            seq = next((s for s in live if s.request_id == idx), None)
            if seq is not None:
                sch.remove(seq)
                live.remove(seq)
                done.add(idx)
        batch = sch.schedule()
        assert len(batch) or not sch.has_unfinished()
        assert batch.prefill_tokens <= budget
        assert all(n == 1 for n in batch.num_tokens[: batch.num_decode])
        for seq, n in zip(batch.seqs, batch.num_tokens):
            assert seq.status is SequenceStatus.RUNNING
            seq.num_computed += n
            assert seq.num_computed <= len(seq)
        for seq in batch.seqs:
            if seq.num_computed == len(seq):
                seq.append(7, -1.0, 0)
                if seq.num_output >= seq.params.max_new_tokens or len(seq) >= max_len:
                    sch.remove(seq)
                    live.remove(seq)
                    done.add(seq.request_id)
        check_invariants(sch, live)
    assert not sch.has_unfinished(), "requests starved"
    assert done == set(range(len(reqs)))
    assert bm.num_free == num_blocks


def test_prefills_blocking_each_other_are_resolved_by_preemption():
    bm = BlockManager(num_blocks=4, block_size=4)
    sch = Scheduler(bm, max_running=2, prefill_chunk_tokens=8)
    a, b = make_seq("a", 12, 2), make_seq("b", 12, 2)
    for s in (a, b):  # both half-prefilled, holding the whole cache between them
        s.status = SequenceStatus.RUNNING
        sch.running.append(s)
        bm.grow(s, 8)
        s.num_computed = 8
    assert bm.num_free == 0
    batch = sch.schedule()
    assert batch.seqs == [a] and batch.num_tokens == [4]
    assert list(sch.waiting) == [b] and b.num_computed == 0 and sch.num_preemptions == 1
