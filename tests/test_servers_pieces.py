"""Parameter-server slots split into GPU pieces, on CPU: the CUDA IPC primitives are replaced by a
registry of CPU tensors, so the piece layout, ownership, reader claims, the pulls into strided
engine parameters, the single sync per push and the atomic segment creation run here; the real
IPC handles run in the device check (scripts/device_check.sh) and the gpu-marked tests."""

import os
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import staleflow.servers.parameter as parameter
import staleflow.servers.pieces as pieces
from staleflow.servers import ParameterServer, ParamLayout, ServerError, TornRead
from staleflow.servers.layout import piece_rows
from staleflow.servers.segment import KIND_RING, Segment, segment_path

SHAPES = {"embed": (11, 6), "q": (6, 6), "norm": (6,), "bias": (3,), "scale": ()}


@pytest.fixture
def fake_ipc(monkeypatch):
    """Pieces as CPU tensors in one registry; each open counts as a mapping by its reader."""
    registry: dict[str, torch.Tensor] = {}
    opened: list[tuple[str, bytes]] = []

    def create(name, nbytes, device, readers):
        registry[name] = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
        return registry[name], [f"{name}/{i}".encode() for i in range(readers)], "GPU-fake"

    def open_(name, blob, uuid_, map_on=None):
        opened.append((name, blob))
        return registry[name]

    monkeypatch.setattr(pieces, "cuda_piece_create", create)
    monkeypatch.setattr(pieces, "cuda_piece_open", open_)
    monkeypatch.setattr(pieces, "cuda_piece_release", lambda name: registry.pop(name, None))
    return registry, opened


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _servers(world: int, readers: int = 2):
    run = "q" + uuid.uuid4().hex[:10]
    layout = ParamLayout.from_named_tensors(_state(0), dtype=torch.bfloat16)
    leader = ParameterServer.create(run, layout, device="cuda:0", pieces=world, readers=readers)
    others = [ParameterServer.attach(run, piece=r, device=f"cuda:{r}") for r in range(1, world)]
    return run, [leader, *others]


def _push_sharded(trainers, version: int, state: dict[str, torch.Tensor]) -> None:
    """Each trainer rank writes exactly FSDP2's dim-0 shard of every parameter (its own piece)."""
    world = len(trainers)
    for ps in trainers:
        ps.begin_push(version)
    for r, ps in enumerate(trainers):
        for name, t in state.items():
            a, b = piece_rows(tuple(t.shape), world, r)
            row = t[0].numel() if t.dim() else 1
            if b > a:
                ps.write_shard(name, t.reshape(-1)[a * row : b * row], a * row)
        ps.end_push()
    trainers[0].publish(version)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=0, max_size=3), st.integers(1, 8))
def test_piece_layouts_partition_every_parameter_like_fsdp2(shape, world):
    shape = tuple(shape)
    layout = ParamLayout.from_specs([("w", shape, "float32")])
    split = layout.split(world)
    n = shape[0] if shape else 1
    rows = [piece_rows(shape, world, p) for p in range(world)]
    chunks = torch.arange(n).chunk(world) if n else ()
    assert [b - a for a, b in rows if b > a] == [len(c) for c in chunks if len(c)]  # torch.chunk's rows
    assert all(rows[p][1] == rows[p + 1][0] or rows[p + 1][0] == rows[p + 1][1] for p in range(world - 1))
    assert sum(s.index()["w"].numel for s in split) == layout.index()["w"].numel


def test_sharded_push_pulls_bit_exact_into_strided_engine_parameters(fake_ipc):
    run, trainers = _servers(world=3)
    reader = ParameterServer.attach(run, reader=1)
    try:
        state = _state(7)
        _push_sharded(trainers, 1, state)
        # destinations with any strides (views of transposed fused matrices, as another engine may hold)
        fused = torch.zeros(6, 11 + 6)
        out = {
            "embed": fused[:, :11].t(),
            "q": fused[:, 11:].t(),
            "norm": torch.zeros(6),
            "bias": torch.zeros(3, dtype=torch.float64),
            "scale": torch.zeros(()),
        }
        assert not out["embed"].is_contiguous()
        reader.pull(1, out=out)
        for k, t in state.items():
            assert torch.equal(out[k], t.bfloat16().to(out[k].dtype)), k  # cast at the slot, exact after
        with reader.stream(1, device="cpu") as tensors:
            streamed = {k: v.clone() for k, v in tensors}
        assert streamed.keys() == state.keys()
        assert all(torch.equal(streamed[k], state[k].bfloat16()) for k in state)
    finally:
        reader.close()
        for ps in reversed(trainers):
            ps.close()


def test_a_rank_writes_only_its_own_piece_and_a_header_only_attach_cannot_pull(fake_ipc):
    run, trainers = _servers(world=2)
    watcher = ParameterServer.attach(run)  # neither piece nor reader: versions only
    try:
        for ps in trainers:
            ps.begin_push(1)
        with pytest.raises(ServerError, match="belong to piece 0, owned by trainer rank 0"):
            trainers[1].write_shard("embed", torch.zeros(66))
        for r, ps in enumerate(trainers):
            for name, t in _state(1).items():
                a, b = piece_rows(tuple(t.shape), 2, r)
                row = t[0].numel() if t.dim() else 1
                if b > a:
                    ps.write_shard(name, t.reshape(-1)[a * row : b * row], a * row)
            ps.end_push()
        trainers[0].publish(1)
        assert watcher.latest_version() == 1
        with pytest.raises(ServerError, match="reader="):
            watcher.pull(1, out={k: torch.zeros(s) for k, s in SHAPES.items()})
    finally:
        watcher.close()
        for ps in reversed(trainers):
            ps.close()


def test_reader_indices_are_claimed_per_process_and_released(fake_ipc):
    registry, opened = fake_ipc
    run, trainers = _servers(world=2, readers=3)
    reader = ParameterServer.attach(run, reader=2)
    try:
        assert {blob for _, blob in opened} == {
            f"staleflow-{run}-ps-{s}-{p}/2".encode() for s in (0, 1) for p in (0, 1)
        }
        with pytest.raises(ServerError, match="already attached in this process"):
            ParameterServer.attach(run, reader=2)
        with pytest.raises(ServerError, match="outside the 3 handles"):
            ParameterServer.attach(run, reader=3)
        piece = reader.slots[0].pieces[1]
        off = pieces.PIECE_HEADER.size + 4 * 0
        piece.seg.buf[off : off + 4] = os.getppid().to_bytes(4, "little")  # index 0 held by a live process
        with pytest.raises(ServerError, match=f"in use by process {os.getppid()}"):
            ParameterServer.attach(run, reader=0)
        piece.seg.buf[off : off + 4] = bytes(4)
        second = ParameterServer.attach(run, reader=0)
        second.close()
        assert reader.slots[0].pieces[1].claimed_by() == [os.getpid()]
    finally:
        reader.close()
    owner_piece = trainers[1].slots[0].pieces[1]
    assert owner_piece.claimed_by() == []  # every reader released its index
    for ps in reversed(trainers):
        ps.close()
    assert registry == {}


def test_owner_keeps_a_piece_that_a_reader_still_maps(fake_ipc):
    registry, _ = fake_ipc
    run, (leader,) = _servers(world=1)
    reader = ParameterServer.attach(run, reader=0)
    name = f"staleflow-{run}-ps-0-0"
    with pytest.warns(UserWarning, match="still map it"):
        leader.slots[0].pieces[0].close(wait_readers_s=0.05)
    assert name in registry  # not released under the reader
    reader.close()
    leader.slots[0].pieces = []
    leader.close()


def test_one_device_sync_per_push_not_per_parameter(fake_ipc, monkeypatch):
    synced = []
    monkeypatch.setattr(parameter, "sync_device", lambda dev: synced.append(dev))
    run, trainers = _servers(world=2)
    try:
        _push_sharded(trainers, 1, _state(1))
        assert len(synced) <= 2 * len(trainers)  # one per device per rank, whatever the parameter count
    finally:
        for ps in reversed(trainers):
            ps.close()


def test_torn_stream_raises(fake_ipc, monkeypatch):
    run, (leader,) = _servers(world=1)
    reader = ParameterServer.attach(run, reader=0)
    try:
        _push_sharded([leader], 1, _state(1))
        sl = reader._slot_of(1)
        with pytest.raises(TornRead, match="load it again"):
            with reader.stream(1, device="cpu") as tensors:
                next(tensors)
                sl.set(bump=True)  # a writer bypassing the lock
                sl.set(bump=True)
    finally:
        reader.close()
        leader.close()


def test_a_segment_appears_only_once_initialised():
    name = "staleflow-t" + uuid.uuid4().hex[:8] + "-ts-0"
    seen = {}

    def init(buf):
        seen["visible_during_init"] = os.path.exists(segment_path(name))
        buf[:4] = b"HEAD"

    seg = Segment.create(name, 64, KIND_RING, init=init)
    try:
        assert seen == {"visible_during_init": False}
        other = Segment.attach(name, KIND_RING)
        assert bytes(other.buf[:4]) == b"HEAD"
        other.close()
    finally:
        seg.close()
        seg.unlink()
