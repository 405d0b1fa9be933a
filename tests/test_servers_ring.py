"""Trajectory Server ring: allocator invariants (hypothesis), record round trips, bad input, hygiene."""

import os
import subprocess
import sys
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.servers import (
    RecordHandle,
    RecordTooLarge,
    RingFull,
    SegmentError,
    ServerError,
    StaleHandle,
    TrajectoryRing,
    cleanup_stale_segments,
    list_segments,
    record_nbytes,
)
from staleflow.servers.ring import RingAllocator, align_up
from staleflow.trajectory import ENV_LOGPROB, ENV_VERSION, TrajectoryTokens


def _run_id() -> str:
    return "t" + uuid.uuid4().hex[:10]


def _record(n_prompt: int, n_resp: int, seed: int = 0, masked: bool = False) -> TrajectoryTokens:
    """Random tokens; masked: a random loss mask whose environment tokens carry the sentinels."""
    g = torch.Generator().manual_seed(seed)
    t = TrajectoryTokens(
        torch.randint(0, 1000, (n_prompt,), generator=g, dtype=torch.int32),
        torch.randint(0, 1000, (n_resp,), generator=g, dtype=torch.int32),
        -torch.rand(n_resp, generator=g),
        torch.randint(0, 5, (n_resp,), generator=g, dtype=torch.int32),
    )
    if masked:
        t.loss_mask = torch.randint(0, 2, (n_resp,), generator=g, dtype=torch.int32)
        t.behaviour_logprobs[t.loss_mask == 0] = ENV_LOGPROB
        t.versions[t.loss_mask == 0] = ENV_VERSION
    return t


def _same(a: TrajectoryTokens, b: TrajectoryTokens) -> bool:
    fields = ("prompt_ids", "response_ids", "behaviour_logprobs", "versions")
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields) and a.mask_values() == b.mask_values()


@pytest.fixture
def ring():
    r = TrajectoryRing.create(_run_id(), 0, 8192)
    yield r
    r.close()
    r.unlink()


# -- allocator: pure bookkeeping, driven by random interleavings -------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    capacity_blocks=st.integers(1, 16),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 6 * 64), st.integers(0, 1000)), max_size=80),
)
def test_allocator_never_overlaps_and_reclaims_everything(capacity_blocks, ops):
    cap = 64 * capacity_blocks
    a = RingAllocator(cap)
    live: dict[int, tuple[int, int]] = {}
    gen = 0
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            gen += 1
            if size > cap:
                with pytest.raises(RecordTooLarge):
                    a.alloc(size, gen)
                continue
            off = a.alloc(size, gen)
            if off is None:
                assert live, "an empty ring must accept any record that fits its capacity"
                continue
            n = (size + 63) // 64 * 64
            assert 0 <= off and off + n <= cap and off % 64 == 0
            for o, m in live.values():  # never overlaps unreleased data
                assert off + n <= o or o + m <= off
            live[gen] = (off, n)
        else:
            g = sorted(live)[pick % len(live)]  # release in any order
            a.release(g, live.pop(g)[0])
            with pytest.raises(StaleHandle):
                a.release(g, 0)
    for g in list(live):
        a.release(g, live.pop(g)[0])
    assert len(a) == 0 and a.used_bytes == 0
    assert a.alloc(cap, gen + 1) == 0  # fully reclaimed: the whole ring is one free extent


def test_out_of_order_free_reclaims_tail_only_when_prefix_free():
    a = RingAllocator(4 * 64)
    offs = [a.alloc(64, g) for g in (1, 2, 3, 4)]
    assert offs == [0, 64, 128, 192] and a.alloc(64, 5) is None
    a.release(3, 128)
    a.release(2, 64)
    assert a.alloc(64, 5) is None  # record 1 still live: nothing reclaimed yet
    assert a.release(1, 0) == [1, 2, 3]
    assert a.alloc(128, 5) == 0  # wraps to the start
    assert a.alloc(64, 6) == 128 and a.alloc(64, 7) is None


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 120), st.integers(0, 10**6)),
        min_size=1,
        max_size=60,
    )
)
def test_ring_reads_back_every_live_record_and_rejects_freed_ones(ops):
    ring = TrajectoryRing.create(_run_id(), 0, 2048)
    try:
        live, dead = {}, []
        for is_write, n_p, n_r, seed in ops:
            if is_write or not live:
                rec = _record(n_p, n_r, seed, masked=seed % 2 == 1)
                try:
                    h = ring.write(rec)
                except RingFull:
                    assert live  # only a ring holding unconsumed records may refuse
                    continue
                except RecordTooLarge:
                    assert record_nbytes(n_p, n_r, rec.loss_mask is not None and 0 in rec.mask_values()) > 2048
                    continue
                live[h] = rec
            else:
                h = sorted(live, key=lambda x: x.generation)[seed % len(live)]
                ring.free(h)
                dead.append(h)
                del live[h]
            for h, rec in live.items():
                assert _same(ring.read(h), rec)
            for h in dead[-3:]:
                with pytest.raises(StaleHandle):
                    ring.read(h)
    finally:
        ring.close()
        ring.unlink()


# -- ring: round trips through shared memory ---------------------------------------------------------------
def test_write_read_round_trip_in_another_attachment(ring):
    recs = [_record(5, 7, 1), _record(1, 0, 2), _record(33, 100, 3, masked=True)]
    handles = [ring.write(r) for r in recs]
    reader = TrajectoryRing.attach(ring.name.split("-")[1], 0)
    try:
        for r, h in zip(recs, handles):
            got = reader.read(h)
            assert _same(got, r)
        with pytest.raises(ServerError, match="only the producer"):
            reader.write(recs[0])
        with pytest.raises(ServerError, match="only the producer"):
            reader.free(handles[0])
    finally:
        reader.close()
    assert all(h.offset % 64 == 0 for h in handles)


def test_masked_payload_round_trips_and_an_all_ones_mask_costs_nothing(ring):
    """A multi-turn payload's loss mask (environment tokens 0, with their sentinels) is a fourth
    response section (flag MASKED), read back and decoded from shipped bytes as written; an all-ones
    mask is stored as none: the record is the size of a single-turn one and reads back None."""
    t = TrajectoryTokens([1, 2, 3], [5, 6, 7, 8], [-0.5, ENV_LOGPROB, ENV_LOGPROB, -0.25], [4, -1, -1, 5], [1, 0, 0, 1])
    t.validate()
    h = ring.write(t)
    assert h.length == 64 + 4 * (3 + 4 * 4)
    got = ring.read(h)
    assert got.loss_mask.tolist() == [1, 0, 0, 1] and got.versions.tolist() == [4, -1, -1, 5]
    assert got.behaviour_logprobs.tolist() == [-0.5, 0.0, 0.0, -0.25] and got.response_ids.tolist() == [5, 6, 7, 8]
    got.validate()
    shipped = TrajectoryRing.decode(bytes(ring.record_view(h)), h)
    assert _same(shipped, got) and shipped.loss_mask is not None
    ones = ring.write(TrajectoryTokens([1, 2, 3], [5, 6], [-0.5, -0.25], [4, 5], [1, 1]))
    plain = ring.write(TrajectoryTokens([1, 2, 3], [5, 6], [-0.5, -0.25], [4, 5]))
    assert ones.length == plain.length == 64 + 4 * (3 + 3 * 2) and ring.read(ones).loss_mask is None


def test_read_returns_copies_not_views(ring):
    h = ring.write(_record(4, 4, 5))
    got = ring.read(h)
    ring.free(h)
    h2 = ring.write(_record(4, 4, 6))  # reuses the same bytes
    assert h2.offset == h.offset and torch.equal(got.prompt_ids, _record(4, 4, 5).prompt_ids)


def test_handle_is_a_small_msgspec_struct():
    import msgspec

    h = RecordHandle(3, 128, 200, 9)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=RecordHandle) == h
    assert len(msgspec.msgpack.encode(h)) < 16


def test_back_pressure_then_resolves(ring):
    rec = _record(10, 50, 7)
    handles = []
    with pytest.raises(RingFull, match="free some and retry"):
        while True:
            handles.append(ring.write(rec))
    assert len(handles) == 8192 // align_up(handles[0].length) == 8192 // record_nbytes(10, 50)
    before = [ring.read(h) for h in handles]
    ring.free(handles[1])  # not the oldest: nothing reclaimed, still full
    with pytest.raises(RingFull):
        ring.write(rec)
    ring.free(handles[0])
    h = ring.write(rec)  # fits now; no live record was touched
    for old, hh in zip(before[2:], handles[2:]):
        assert _same(ring.read(hh), old)
    assert _same(ring.read(h), before[0])


# -- bad input ------------------------------------------------------------------------------------------
def test_record_larger_than_ring_is_a_clear_error_and_corrupts_nothing(ring):
    h = ring.write(_record(3, 3, 8))
    with pytest.raises(RecordTooLarge, match="can never fit"):
        ring.write(_record(100, 1000, 9))
    assert _same(ring.read(h), ring.read(h)) and ring.live_records == 1


def test_stale_handle_and_double_free(ring):
    h = ring.write(_record(3, 3, 10))
    ring.free(h)
    with pytest.raises(StaleHandle, match="freed"):
        ring.read(h)
    with pytest.raises(StaleHandle, match="already freed"):
        ring.free(h)
    h2 = ring.write(_record(3, 3, 11))  # same offset, new generation
    assert h2.offset == h.offset and h2.generation != h.generation
    with pytest.raises(StaleHandle):
        ring.read(h)
    with pytest.raises(StaleHandle):
        ring.free(h)
    with pytest.raises(StaleHandle, match="rank 5"):
        ring.read(RecordHandle(5, h2.offset, h2.length, h2.generation))
    with pytest.raises(StaleHandle, match="out of bounds"):
        ring.read(RecordHandle(0, 1 << 20, h2.length, h2.generation))
    assert _same(ring.read(h2), _record(3, 3, 11))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(behaviour_logprobs=torch.zeros(2)), "one of each per response token"),
        (dict(loss_mask=torch.ones(2, dtype=torch.int32)), "2 loss_mask entries"),
        (dict(prompt_ids=torch.zeros(2, 2, dtype=torch.int32)), "must be 1-D"),
        (dict(response_ids=torch.zeros(3)), "need torch.int32"),
    ],
)
def test_bad_records_rejected(ring, bad, match):
    r = _record(2, 3, 12)
    for k, v in bad.items():
        setattr(r, k, v)
    with pytest.raises(ValueError, match=match):
        ring.write(r)
    assert ring.live_records == 0


def test_bad_names_and_missing_segments():
    with pytest.raises(SegmentError, match="run_id"):
        TrajectoryRing.create("bad-id", 0, 4096)
    with pytest.raises(SegmentError, match="does not exist"):
        TrajectoryRing.attach(_run_id(), 0)
    run = _run_id()
    r = TrajectoryRing.create(run, 1, 4096)
    try:
        with pytest.raises(SegmentError, match="already exists"):
            TrajectoryRing.create(run, 1, 4096)
    finally:
        r.close()
        r.unlink()


# -- segment hygiene ------------------------------------------------------------------------------------
def test_segments_removed_at_normal_exit():
    run = _run_id()
    code = "import sys; from staleflow.servers import TrajectoryRing as R; r = R.create(sys.argv[1], 0, 4096)"
    subprocess.run([sys.executable, "-c", code, run], check=True, timeout=120)
    assert list_segments(f"staleflow-{run}") == []  # unlinked by the creator's finalizer at exit


def test_crashed_run_segments_removed_by_cleanup():
    run = _run_id()
    pid = os.fork()
    if pid == 0:  # child: create two rings and die without any cleanup (like SIGKILL)
        code = 1
        try:
            rings = [TrajectoryRing.create(run, 0, 4096), TrajectoryRing.create(run, 1, 4096)]
            code = 0 if len(rings) == 2 else 1
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    left = list_segments(f"staleflow-{run}")
    assert len(left) == 2
    mine = TrajectoryRing.create(_run_id(), 0, 4096)  # a live process's segment must survive cleanup
    try:
        removed = cleanup_stale_segments()
        assert set(left) <= set(removed) and mine.name not in removed
        assert list_segments(f"staleflow-{run}") == [] and os.path.exists(f"/dev/shm/{mine.name}")
    finally:
        mine.close()
        mine.unlink()
