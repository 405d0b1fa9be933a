"""Roles across nodes (pure): who ships records where, who pulls weights over the network, which
layouts are refused, and the table printed at start. Node identity is torchrun's, not the host's."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleflow.cluster.roles import Roles
from staleflow.cluster.topology import Topology
from staleflow.config import ConfigError, RolloutConfig, RunConfig
from staleflow.engines import engine_backend
from staleflow.launch import dist


def _backend(engine: str):
    return engine_backend(RunConfig(rollout=RolloutConfig(engine=engine)))


def two_nodes(rollout: int, per_node: int = 2) -> Topology:
    world = 2 * per_node
    return Topology.from_ranks(
        Roles(world, rollout),
        [r // per_node for r in range(world)],
        [r % per_node for r in range(world)],
        {0: "127.0.0.1", 1: "127.0.0.1"},
    )


def test_multinode_acceptance_layout_puts_both_rollout_ranks_on_the_node_without_the_controller():
    topo = two_nodes(rollout=2)
    assert topo.multi_node and topo.home == 0
    assert topo.roles.trainer_ranks == [0, 1] and topo.ranks_on(1) == [2, 3]
    assert topo.ships_to(2) == topo.ships_to(3) == [0]  # finished records go to the trainers' node
    assert topo.remote_pullers == [2, 3]  # weights come over the network
    assert topo.receiver_rank(0) == 0 and topo.receiver_rank(1) is None
    assert not topo.fetches_partials  # both rollout ranks share node 1: partials stay in its /dev/shm
    topo.validate()
    assert topo.describe("tcp://127.0.0.1:5") == (
        "staleflow: 4 ranks on 2 nodes (2 trainer, 2 rollout); controller and Parameter Server on node 0 "
        "(tcp://127.0.0.1:5)\n"
        "  node 0 [127.0.0.1]: rank 0 trainer (leader), rank 1 trainer\n"
        "  node 1 [127.0.0.1]: rank 2 rollout 0, rank 3 rollout 1"
    )


def test_multinode_rollout_ranks_on_both_nodes_fetch_partials_and_only_remote_ones_ship():
    topo = two_nodes(rollout=3)
    assert topo.roles.rollout_ranks == [1, 2, 3]
    assert topo.ships_to(1) == [] and topo.ships_to(2) == [0]
    assert topo.remote_pullers == [2, 3] and topo.fetches_partials


def test_multinode_trainer_ranks_on_both_nodes_are_accepted_and_vllm_refused_for_them():
    topo = two_nodes(rollout=1)  # trainer ranks 0, 1 (node 0) and 2 (node 1), rollout rank 3 on node 1
    topo.validate(_backend("builtin"))
    assert topo.trainer_nodes == [0, 1] and topo.full_nodes == [] and topo.remote_pullers == [3]
    with pytest.raises(ConfigError, match=r"--rollout.engine=vllm on rollout ranks \[3\]"):
        topo.validate(_backend("vllm"))
    with pytest.raises(ConfigError, match=r"--rollout.engine=vllm on rollout ranks \[2, 3\]"):
        two_nodes(rollout=2).validate(_backend("vllm"))
    two_nodes(rollout=2).validate(_backend("builtin"))
    assert topo.describe().splitlines()[0] == (
        "staleflow: 4 ranks on 2 nodes (3 trainer, 1 rollout); controller on node 0; trainers (FSDP over all) "
        "and Parameter Server pieces on nodes 0, 1"
    )


def test_multinode_trainer_hsdp_needs_as_many_trainer_ranks_on_every_node():
    uneven = dataclasses.replace(two_nodes(rollout=1), replicated=True)
    with pytest.raises(ConfigError, match=r"--cluster.sharding hsdp .* \(node 0: 2, node 1: 1\)"):
        uneven.validate()
    # torchrun allows another --nproc-per-node per node: 1 trainer on node 0, 1 trainer + 1 rollout on node 1
    even = Topology.from_ranks(Roles(3, 1), [0, 1, 1], [0, 0, 1], replicated=True)
    even.validate()
    assert even.shard_size == 1 and even.full_nodes == [0, 1]
    assert even.remote_pullers == [2]  # node 1 holds every weight: it reads node 1's (not node 0's, as vLLM would)


def test_multinode_single_node_has_nothing_to_send():
    topo = Topology.single_node(Roles(3, 2))
    assert not topo.multi_node and topo.remote_pullers == [] and topo.ships_to(1) == []
    assert topo.describe().splitlines()[1] == "  node 0: rank 0 trainer (leader), rank 1 rollout 0, rank 2 rollout 1"


def test_multinode_node_identity_is_torchruns_group_rank_not_the_hostname(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "same-machine")
    a = dist.read_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"})
    b = dist.read_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert (a.node_rank, b.node_rank) == (0, 1)  # one host, two nodes


@given(st.lists(st.integers(1, 4), min_size=2, max_size=5), st.integers(1, 12))
def test_multinode_every_trainer_node_gets_every_finished_record(per_node, rollout):
    world = sum(per_node)
    if rollout >= world:
        return
    nodes = [n for n, k in enumerate(per_node) for _ in range(k)]
    topo = Topology.from_ranks(Roles(world, rollout), nodes, [0] * world)
    for r in topo.roles.rollout_ranks:
        reach = set(topo.ships_to(r)) | ({topo.node_of(r)} & set(topo.trainer_nodes))
        assert reach == set(topo.trainer_nodes)
        assert topo.node_of(r) not in topo.ships_to(r)
    if topo.trainer_nodes == [nodes[0]]:
        assert topo.remote_pullers == [r for r in topo.roles.rollout_ranks if nodes[r] != nodes[0]]
    else:  # FSDP across nodes: no node holds every weight
        assert topo.full_nodes == [] and topo.remote_pullers == topo.roles.rollout_ranks
    topo.validate()  # trainer ranks may sit on any node
