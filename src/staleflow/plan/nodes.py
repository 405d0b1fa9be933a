"""The memory plan across nodes: where ``--nodes K`` puts every rank, what the weight pulls cost each
node's GPUs in contexts, and what one weight update moves between nodes.

    topo = plan_topology(cfg, nproc=64, nodes=8)          # ranks node by node, trainer ranks first
    place = slot_placement(topo, "cuda")                  # the runtime's own placement (cluster/placement.py)
    add_pull_contexts(ranks, topo, place, gpu)            # IPC contexts on piece GPUs, NCCL pull groups
    cross, sent = update_traffic(topo, place, layout)     # bytes per weight update: all, and per sending node

Everything here is the runtime's rule: the same Topology (trainer ranks on the first nodes, FSDP over
all of them or HSDP with --cluster.sharding hsdp), the same piece placement and the same copy plan
(``SlotPlacement.pull_plan``) that launch/dist.run_groups and the rollout ranks use.
"""

from __future__ import annotations

from collections import Counter

from staleflow.cluster.roles import Roles
from staleflow.cluster.topology import Topology
from staleflow.plan.estimate import NCCL_BYTES, NCCL_PULL_BYTES, PEER_CONTEXT_BYTES


def plan_topology(cfg, nproc: int, nodes: int) -> Topology:
    """``nproc`` ranks in all on ``nodes`` nodes of nproc / nodes each, numbered node by node as
    torchrun does; roles as the run's (trainer ranks first)."""
    roles = Roles(nproc, cfg.rollout.ranks)
    per_node = nproc // nodes
    return Topology.from_ranks(
        roles,
        [r // per_node for r in range(nproc)],
        [r % per_node for r in range(nproc)],
        replicated=cfg.cluster.sharding == "hsdp",
    )


def shard_of(topo: Topology, rank: int) -> tuple[int, int]:
    """(shard index, shards) of a trainer rank: its rank among all trainer ranks (FSDP), or among its
    node's (HSDP)."""
    if not topo.replicated:
        return rank, topo.roles.num_trainer
    here = topo.trainers_on(topo.node_of(rank))
    return here.index(rank), len(here)


def add_pull_contexts(ranks, topo: Topology, place, gpu) -> None:
    """Contexts the weight pulls cost (``gpu(rank)``: a rank's GPU number): every puller maps its own
    node's pieces by CUDA IPC (one context on each such GPU that is not its own); every puller that
    takes pieces from other nodes has an NCCL group with their owners (on each member); HSDP across
    nodes adds the replicate group's communicator on every trainer rank."""
    by_rank = {rp.rank: rp for rp in ranks}
    foreign: Counter = Counter()
    groups: Counter = Counter()
    for r in topo.roles.rollout_ranks:
        node = topo.node_of(r)
        for p in place.pull_plan(node, r):
            spec = place.pieces[p]
            if spec.node == node and gpu(spec.owner) != gpu(r):
                foreign[gpu(spec.owner)] += 1
        owners = place.remote_owners(node, r)
        if owners:
            by_rank[r].add("contexts", NCCL_PULL_BYTES, f"its weight-pull NCCL group with {len(owners)} piece owners")
            groups.update(owners)
    for g, n in sorted(foreign.items()):
        owner = next(rp for rp in ranks if rp.gpu == g)
        owner.add("contexts", n * PEER_CONTEXT_BYTES, f"{n} pullers' IPC contexts on GPU {g}")
    hsdp = topo.replicated and len(topo.trainer_nodes) > 1
    for r in topo.roles.trainer_ranks:
        rp = by_rank[r]
        if groups[r]:
            rp.add("contexts", groups[r] * NCCL_PULL_BYTES, f"{groups[r]} remote pullers' NCCL groups")
        elif not topo.multi_node:
            rp.notes.append(
                f"contexts: no remote pullers (each rollout rank on another node adds {NCCL_PULL_BYTES >> 20} MiB "
                f"of NCCL group here: plan it with --nodes)"
            )
        if hsdp:
            rp.add("contexts", NCCL_BYTES, "HSDP: the replicate group's communicator (gradients across nodes)")


def update_traffic(topo: Topology, place, layout) -> tuple[int, dict[int, int]]:
    """(bytes one weight update moves between nodes, those bytes by the node that sends them): every
    rollout instance pulls every piece once, from its own node where it can (shared memory / CUDA
    IPC: not counted), else from the replica its copy plan names."""
    sent: dict[int, int] = {}
    for r in topo.roles.rollout_ranks:
        node = topo.node_of(r)
        for src, nbytes in place.bytes_by_node(layout, node, r).items():
            if src != node:
                sent[src] = sent.get(src, 0) + nbytes
    return sum(sent.values()), dict(sorted(sent.items()))
