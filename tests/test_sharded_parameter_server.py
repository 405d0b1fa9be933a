"""The Parameter Server sharded across trainer nodes: each trainer node holds its ranks' pieces (one per
rank on GPU, one per node on CPU; with HSDP every node holds a replica of every piece), and a puller
copies each row range once, from its own node where it can and from the piece's owner elsewhere.

Pure placement properties over random layouts; two nodes' servers side by side on CPU (and on GPU
pieces through the fake IPC registry of test_servers_pieces); and three real processes on gloo: two
owners on two nodes publishing versions while a puller on the second node copies its node's piece
from shared memory and the other node's from its owner, every pull one whole version."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from test_servers_pieces import fake_ipc  # noqa: F401 - the fixture

from staleflow.cluster.placement import cluster_placement, ps_egress_gb_s, slot_placement
from staleflow.cluster.roles import Roles
from staleflow.cluster.topology import Topology
from staleflow.servers import ParameterServer, ParamLayout, ServerError
from staleflow.shards import PieceSpec

SPECS = [("embed", (37, 8), "float32"), ("norm", (8,), "float32"), ("scale", (), "float32"), ("w", (5, 3), "float32")]


def _topology(per_node: list[int], rollout: int, replicated: bool = False) -> Topology:
    world = sum(per_node)
    nodes = [n for n, k in enumerate(per_node) for _ in range(k)]
    local = [i for k in per_node for i in range(k)]
    return Topology.from_ranks(Roles(world, rollout), nodes, local, replicated=replicated)


def _covered(pieces, shape) -> list[int]:
    """How many pieces hold each row of a parameter of ``shape``."""
    n = shape[0] if shape else 1
    count = [0] * n
    for p in pieces:
        a, b = p.rows(shape)
        for i in range(a, b):
            count[i] += 1
    return count


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(1, 6), st.sampled_from(["cpu", "cuda"]))
def test_sharded_parameter_server_fsdp_pieces_hold_every_row_once_on_its_trainers_node(per_node, rollout, device):
    if rollout >= sum(per_node):
        return
    topo = _topology(per_node, rollout)
    place = slot_placement(topo, device)
    trainer_nodes = topo.trainer_nodes
    assert place.nodes == trainer_nodes
    for spec in place.pieces:
        assert topo.node_of(spec.owner) == spec.node and spec.owner in topo.roles.trainer_ranks
        assert spec.shards == topo.roles.num_trainer
    if device == "cuda":  # one piece per trainer rank, on its GPU: piece r is rank r's FSDP2 rows
        assert [(p.owner, p.lo, p.hi) for p in place.pieces] == [(r, r, r + 1) for r in topo.roles.trainer_ranks]
    else:  # one piece per trainer node, in its shared memory, owned by its first trainer rank
        assert [p.owner for p in place.pieces] == [topo.trainers_on(n)[0] for n in trainer_nodes]
    layout = ParamLayout.from_specs(SPECS)
    full = sum(layout.piece_bytes(p) for p in place.pieces)
    for _, shape, _ in SPECS:
        assert _covered(place.pieces, shape) == [1] * (shape[0] if shape else 1)
    for r in topo.roles.rollout_ranks:
        node = topo.node_of(r)
        plan = place.pull_plan(node, r)
        assert sorted(plan) == list(range(len(place.pieces)))  # every piece, each once, from its owner
        by_node = place.bytes_by_node(layout, node, r)
        assert sum(by_node.values()) == full
        assert set(place.remote_owners(node, r)) == {p.owner for p in place.pieces if p.node != node}


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(1, 3), st.integers(1, 5), st.sampled_from(["cpu", "cuda"]))
def test_sharded_parameter_server_hsdp_replicas_spread_the_pullers_of_other_nodes(nodes, shards, extra, device):
    per_node = [shards] * nodes + [extra]  # the trainer nodes full of trainer ranks, the rollout ranks after
    topo = _topology(per_node, extra, replicated=True)
    topo.validate()
    place = slot_placement(topo, device)
    layout = ParamLayout.from_specs(SPECS)
    for node in topo.trainer_nodes:  # every trainer node holds every row: a replica
        assert place.holds_all(node)
        here = [place.pieces[i] for i in place.on_node(node)]
        for _, shape, _ in SPECS:
            assert _covered(here, shape) == [1] * (shape[0] if shape else 1)
    sources = {}
    for r in topo.roles.rollout_ranks:  # the rollout node holds nothing: each range from one replica
        plan = place.pull_plan(topo.node_of(r), r)
        assert len(plan) == len(place.ranges())
        sources[r] = {place.pieces[i].node for i in plan}
        assert sum(place.bytes_by_node(layout, topo.node_of(r), r).values()) == layout.piece_bytes(
            PieceSpec(0, 0, 0, 1, 1)
        )
    if len(topo.roles.rollout_ranks) >= nodes:  # consecutive pullers take consecutive replicas
        assert set().union(*sources.values()) == set(topo.trainer_nodes)


def test_sharded_parameter_server_placement_of_the_papers_shapes():
    """40 trainer GPUs (Qwen3-30B-A3B's script) fill 5 nodes, 512 (the 1024-GPU row) 64: each owner's NIC
    sends its piece, which is the egress the simulator assumes (25 GB/s per trainer GPU)."""
    place = cluster_placement(40)
    assert place.nodes == [0, 1, 2, 3, 4] and len(place.pieces) == 40
    assert [len(place.on_node(n)) for n in place.nodes] == [8] * 5
    assert ps_egress_gb_s(40) == 25.0 * 40 and ps_egress_gb_s(512) == 25.0 * 512 and ps_egress_gb_s(0) == 0.0
    assert len(cluster_placement(512).nodes) == 64


def _values(version: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape, _dt in SPECS:
        n = max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
        out[name] = (torch.arange(n, dtype=torch.float32) % 89 + 1000 * version + 7 * len(name)).reshape(shape)
    return out


def _write(ps: ParameterServer, ranks: list[int], world: int, state: dict[str, torch.Tensor]) -> None:
    """What trainer ranks ``ranks`` of ``world`` write: their FSDP2 rows of every parameter."""
    for r in ranks:
        for name, t in state.items():
            spec = PieceSpec(r, 0, r, r + 1, world)
            a, b = spec.rows(tuple(t.shape))
            row = t[0].numel() if t.dim() else 1
            if b > a:
                ps.write_shard(name, t.reshape(-1)[a * row : b * row], a * row)


def test_sharded_parameter_server_two_nodes_on_cpu_hold_and_publish_their_own_rows():
    """FSDP over 3 trainer ranks, ranks 0-1 on node 0 and rank 2 on node 1: a CPU piece per node."""
    topo = _topology([2, 2], rollout=1)
    place = slot_placement(topo, "cpu")
    assert [(p.owner, p.node, p.lo, p.hi) for p in place.pieces] == [(0, 0, 0, 2), (2, 1, 2, 3)]
    run = "sp" + uuid.uuid4().hex[:8]
    layout = ParamLayout.from_specs(SPECS)
    node0 = ParameterServer.create(run, layout, pieces=place.pieces, node=0)
    node1 = ParameterServer.create(run, layout, pieces=place.pieces, node=1)
    reader = ParameterServer.attach(run, node=1)  # a rollout rank on node 1
    try:
        assert node0.local == [0] and node1.local == [1] and not node1.holds_all
        assert {f for f in os.listdir("/dev/shm") if run in f} == {
            f"staleflow-{run}-ps-{s}{n}" for s in (0, 1) for n in ("", "-n1")
        }
        # each node's slot holds only its rows: 2/3 of the embedding's 37 rows on node 0, the rest on node 1
        assert node0.layout.piece(place.pieces[0]).index()["embed"].shape == (26, 8)
        state = _values(3)
        for ps in (node0, node1):
            ps.begin_push(3)
        with pytest.raises(ServerError, match="not all held on node 1"):  # rank 0's rows live on node 0
            _write(node1, [0], 3, state)
        _write(node0, [0, 1], 3, state)
        _write(node1, [2], 3, state)
        for ps in (node0, node1):
            ps.end_push()
            ps.publish(3)
        assert node0.latest_version() == node1.latest_version() == reader.latest_version() == 3
        out = {name: torch.full(t.shape, -1.0) for name, t in state.items()}
        assert reader.read_local(3, out) is True
        for name, t in state.items():  # node 1's rows arrived, the others are untouched
            a, b = place.pieces[1].rows(tuple(t.shape))
            if t.dim():
                assert torch.equal(out[name][a:b], t[a:b]) and bool((out[name][:a] == -1).all()), name
        with pytest.raises(ServerError, match="holds only pieces"):
            with reader.stream(3):
                pass
    finally:
        reader.close()
        node1.close()
        node0.close()
    assert not [f for f in os.listdir("/dev/shm") if run in f]


def test_sharded_parameter_server_gpu_pieces_per_rank_on_two_nodes(fake_ipc):  # noqa: F811
    """CUDA placement: a piece per trainer rank; node 1's leader (rank 2) creates node 1's slots, and a
    puller there maps node 1's pieces only."""
    registry, opened = fake_ipc
    topo = _topology([2, 3], rollout=2)  # trainer ranks 0, 1 | 2; rollout 3, 4 on node 1
    place = slot_placement(topo, "cuda")
    run = "sg" + uuid.uuid4().hex[:8]
    layout = ParamLayout.from_specs(SPECS)
    n0 = ParameterServer.create(run, layout, "cuda:0", pieces=place.pieces, readers=place.readers, node=0)
    r1 = ParameterServer.attach(run, piece=1, device="cuda:1", node=0)
    n1 = ParameterServer.create(run, layout, "cuda:0", pieces=place.pieces, readers=place.readers, node=1)
    puller = None
    try:
        with pytest.raises(ServerError, match="node 1 holds pieces \\[2\\]"):
            ParameterServer.attach(run, piece=0, device="cuda:1", node=1)
        state = _values(1)
        for ps in (n0, r1, n1):
            ps.begin_push(1)
        _write(n0, [0], 3, state)
        _write(r1, [1], 3, state)
        _write(n1, [2], 3, state)
        for ps in (n0, r1, n1):
            ps.end_push()
        n0.publish(1)
        n1.publish(1)
        puller = ParameterServer.attach(run, reader=3, node=1)
        assert {name for name, _ in opened} == {f"staleflow-{run}-ps-{s}-2" for s in (0, 1)}  # node 1's piece only
        out = {name: torch.zeros(t.shape) for name, t in state.items()}
        assert puller.read_local(1, out) is True
        a, b = place.pieces[2].rows((37, 8))
        assert torch.equal(out["embed"][a:b], state["embed"][a:b]) and not out["embed"][:a].any()
    finally:
        for ps in (puller, n1, r1, n0):
            if ps is not None:
                ps.close()


VERSIONS = 25


def _rank(rank: int, store: str, run_id: str, secret: bytes, result: str) -> None:
    """Rank 0: trainer rank 0 on node 0 (its node's piece); rank 1: trainer rank 1 on node 1; rank 2: a
    rollout rank on node 1 pulling node 1's piece from shared memory and node 0's from rank 0."""
    from staleflow.net.curve import RunKeys, SecureContext
    from staleflow.servers.remote_weights import RemoteWeights, WeightServer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    group = dist.new_group([0, 2])  # the puller's group: the owners it pulls from over the network + itself
    trainers = dist.new_group([0, 1])  # the trainer's barriers keep the nodes' versions within one of each other
    topo = _topology([1, 2], rollout=1)
    place = slot_placement(topo, "cpu")
    layout = ParamLayout.from_specs(SPECS)
    keys = RunKeys(secret, 3)
    if rank in (0, 1):
        ps = ParameterServer.create(run_id, layout, pieces=place.pieces, node=rank)
        secure = SecureContext(keys, f"rank {rank}", rank)
        server = None
        endpoint = [""]
        if rank == 0:
            sock, endpoint[0] = secure.server(zmq.ROUTER, "127.0.0.1", b"weights")
            server = WeightServer(ps, 0, sock, {2: group}, "cpu")
        for v in range(VERSIONS):
            ps.begin_push(v)
            _write(ps, [rank], 2, _values(v))
            ps.end_push()
            dist.barrier(group=trainers)
            ps.publish(v)
            dist.barrier(group=trainers)
            if v == 0:  # the puller starts once version 0 is out (the runtime's first Pull follows it)
                dist.broadcast_object_list(endpoint, src=0)
            time.sleep(0.02)
        dist.barrier()
        served = server.served if server is not None else 1
        if server is not None:
            server.close()
        ps.close()
        secure.close()
        assert served > 0
    else:
        endpoint = [None]
        dist.broadcast_object_list(endpoint, src=0)
        secure = SecureContext(keys, "rank 2", 2)
        local = ParameterServer.attach(run_id, timeout=60, node=1)
        assert place.pull_plan(1, 2) == [0, 1] and place.remote_owners(1, 2) == [0]
        puller = RemoteWeights({0: secure.client(zmq.DEALER, endpoint[0])}, place.pieces, group, "cpu", local=local)
        out = {
            "embed": torch.zeros(8, 37).t(),
            "norm": torch.zeros(8),
            "scale": torch.zeros(()),
            "w": torch.zeros(5, 3),
        }
        want = {n: layout.piece_bytes(place.pieces[p]) for n, p in ((0, 0), (1, 1))}
        seen = []
        while not seen or seen[-1] < VERSIONS - 1:
            v, by_node = puller.pull_latest(out)
            assert by_node == want, (by_node, want)
            for name, t in _values(v).items():
                assert torch.equal(out[name], t), f"{name} is not version {v}"
            seen.append(v)
        assert seen == sorted(seen)
        with open(result, "w") as f:
            f.write(",".join(map(str, seen)))
        puller.close()
        secure.close()
        dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_parameter_server_a_puller_takes_its_nodes_piece_locally_and_the_other_from_its_owner(tmp_path):
    from staleflow.net.curve import new_secret

    result, run_id = tmp_path / "seen.txt", uuid.uuid4().hex[:10]
    mp.spawn(_rank, args=(str(tmp_path / "store"), run_id, new_secret(), str(result)), nprocs=3, join=True)
    seen = [int(v) for v in result.read_text().split(",")]
    assert seen[-1] == VERSIONS - 1 and len(seen) >= 2
    assert not [f for f in os.listdir("/dev/shm") if run_id in f]
