"""Parameter Server in one process: layout, sharded pushes, double buffering, locks, bad input."""

import fcntl
import uuid

import msgspec
import pytest
import torch

from staleflow.servers import ParameterServer, ParamLayout, ServerError, TornRead, VersionNotFound
from staleflow.servers.parameter import FILLING, PUBLISHED


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "wte": torch.randn(10, 4, generator=g),
        "ln.bias": torch.randn(3, generator=g).bfloat16(),
        "head": torch.randn(7, 5, generator=g).half(),
        "count": torch.tensor(seed),
    }


@pytest.fixture
def servers():
    run = "p" + uuid.uuid4().hex[:10]
    leader = ParameterServer.create(run, ParamLayout.from_named_tensors(_state(0)))
    reader = ParameterServer.attach(run)
    yield leader, reader, run
    reader.close()
    leader.close()


def _push(ps: ParameterServer, version: int, state: dict[str, torch.Tensor]) -> None:
    ps.begin_push(version)
    for name, t in state.items():
        ps.write_shard(name, t)
    ps.publish(version)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_layout_is_aligned_serialisable_and_ordered():
    lay = ParamLayout.from_named_tensors(_state(0))
    assert lay.names() == ["wte", "ln.bias", "head", "count"]
    assert all(e.offset % 256 == 0 for e in lay.entries)
    ends = [e.offset + e.nbytes for e in lay.entries]
    assert all(end <= nxt.offset for end, nxt in zip(ends, lay.entries[1:])) and ends[-1] <= lay.nbytes
    assert ParamLayout.decode(lay.encode()) == lay
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(lay), type=ParamLayout) == lay
    cast = ParamLayout.from_named_tensors(_state(0), dtype=torch.bfloat16)
    assert [e.dtype for e in cast.entries] == ["bfloat16"] * 3 + ["int64"]
    with pytest.raises(ValueError, match="appears twice"):
        ParamLayout.from_named_tensors([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="complex64"):
        ParamLayout.from_named_tensors({"z": torch.zeros(2, dtype=torch.complex64)})


def test_pull_is_bit_exact_in_place_and_as_copies(servers):
    leader, reader, _ = servers
    assert reader.latest_version() is None
    _push(leader, 1, _state(1))
    out = reader.layout.empty()
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    assert reader.pull(1, out=out) is out and _equal(out, _state(1))
    assert {k: v.data_ptr() for k, v in out.items()} == ptrs  # loaded in place
    fresh = reader.pull(1)
    _push(leader, 2, _state(2))
    assert _equal(fresh, _state(1))  # pulled tensors are copies, untouched by later pushes
    assert reader.pull_latest()[0] == 2 and _equal(reader.pull(2), _state(2))


def test_shards_from_several_writers_assemble_the_full_tensor(servers):
    leader, _, run = servers
    other = ParameterServer.attach(run)  # a second trainer rank
    try:
        full = _state(3)
        assert leader.begin_push(1) == other.begin_push(1)
        for name, t in full.items():
            flat = t.reshape(-1)
            cut = flat.numel() // 2
            leader.write_shard(name, flat[:cut], 0)
            other.write_shard(name, flat[cut:], cut)  # dim-0 shard: offset = first row * row size
        with pytest.raises(ServerError, match="only the leader"):
            other.publish(1)
        leader.publish(1)
        assert _equal(other.pull(1), full)
        assert leader.begin_push(2) == other.begin_push(
            2
        )  # shards in another dtype (e.g. fp64 master weights) are cast to the slot's
        wide = {k: v.double() if v.is_floating_point() else v for k, v in _state(4).items()}
        for name, t in wide.items():
            other.write_shard(name, t)
        leader.publish(2)
        assert _equal(other.pull(2), {k: v.to(full[k].dtype) for k, v in wide.items()})
    finally:
        other.close()


def test_double_buffering_keeps_previous_version_until_next_push(servers):
    leader, reader, _ = servers
    _push(leader, 1, _state(1))
    _push(leader, 2, _state(2))
    assert reader.published_versions() == [1, 2]
    slot = leader.begin_push(3)  # reclaims the slot of version 1, never the newest
    assert reader.published_versions() == [2] and reader.slots[slot].header()[:2] == (FILLING, 3)
    with pytest.raises(VersionNotFound, match="pull the latest"):
        reader.pull(1)
    with pytest.raises(VersionNotFound, match=r"version=3"):
        reader.pull(3)  # filling, not yet published
    assert _equal(reader.pull(2), _state(2))
    for name, t in _state(3).items():
        leader.write_shard(name, t)
    leader.publish(3)
    assert reader.slots[slot].header()[0] == PUBLISHED and _equal(reader.pull(3), _state(3))


def test_push_waits_for_a_reader_copying_the_target_slot(servers):
    leader, reader, _ = servers
    _push(leader, 1, _state(1))
    _push(leader, 2, _state(2))
    target = reader._slot_of(1)
    fcntl.flock(target.lock_fd, fcntl.LOCK_SH)  # a reader mid-copy of version 1
    try:
        with pytest.raises(TimeoutError, match="locked by a reader"):
            leader.begin_push(3, timeout=0.05)
        assert _equal(reader.pull(1), _state(1))  # untouched
    finally:
        fcntl.flock(target.lock_fd, fcntl.LOCK_UN)
    leader.begin_push(3, timeout=1.0)
    assert reader.published_versions() == [2]


def test_torn_copy_is_detected_not_returned(servers, monkeypatch):
    leader, reader, _ = servers
    _push(leader, 1, _state(1))
    sl = reader._slot_of(1)
    real_header = type(sl).header
    calls = {"n": 0}

    def racing_header(self):  # a writer bypassing the lock bumps the stamp during every copy
        calls["n"] += 1
        st, v, stamp = real_header(self)
        return st, v, stamp + 2 * (calls["n"] % 2 == 0)

    monkeypatch.setattr(type(sl), "header", racing_header)
    with pytest.raises(TornRead, match="bypassing the slot lock"):
        reader.pull(1, retries=2)


def test_bad_pushes_and_pulls(servers):
    leader, reader, _ = servers
    with pytest.raises(VersionNotFound, match="nothing"):
        reader.pull(0)
    with pytest.raises(VersionNotFound, match="no version has been published"):
        reader.pull_latest()
    with pytest.raises(ServerError, match="before begin_push"):
        leader.write_shard("wte", torch.zeros(40))
    with pytest.raises(ServerError, match="begin_push"):
        leader.publish(1)
    _push(leader, 5, _state(5))
    with pytest.raises(ValueError, match="already published"):
        leader.begin_push(5)
    leader.begin_push(6)
    with pytest.raises(KeyError, match="not in the layout"):
        leader.write_shard("nope", torch.zeros(1))
    with pytest.raises(ValueError, match=r"outside the parameter's 40 elements"):
        leader.write_shard("wte", torch.zeros(8), offset_in_param=36)
    with pytest.raises(ServerError, match="no slot is filling version 7"):
        leader.publish(7)
    out = reader.layout.empty()
    out["wte"] = torch.zeros(4, 10)
    with pytest.raises(ValueError, match="shape"):
        reader.pull(5, out=out)
    del out["wte"]
    with pytest.raises(KeyError, match="missing"):
        reader.pull(5, out=out)
    assert _equal(reader.pull(5), _state(5))  # nothing corrupted by the bad calls
    with pytest.raises(ValueError, match="device"):
        ParameterServer.create("x1", leader.layout, device="meta")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_slots_round_trip_in_process():
    run = "g" + uuid.uuid4().hex[:10]
    leader = ParameterServer.create(run, ParamLayout.from_named_tensors(_state(0)), device="cuda", readers=1)
    reader = ParameterServer.attach(run, reader=0)
    try:
        _push(leader, 1, {k: v.cuda() for k, v in _state(1).items()})
        out = {k: v.cuda() for k, v in reader.layout.empty().items()}
        reader.pull(1, out=out)
        assert _equal({k: v.cpu() for k, v in out.items()}, _state(1))
    finally:
        reader.close()
        leader.close()
