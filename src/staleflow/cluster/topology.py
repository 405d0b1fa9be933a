"""Which rank runs on which node, and what therefore crosses the network (pure, no torch).

    topo = Topology.from_ranks(roles, nodes=[0, 0, 1, 1], local_ranks=[0, 1, 0, 1], addrs={0: "10.0.0.1", 1: ...})
    topo.home                  # node of global rank 0: the controller and the trainer leader
    topo.trainer_nodes         # nodes with trainer ranks: each holds its ranks' Parameter Server pieces
    topo.ships_to(rank)        # nodes a rollout rank sends its finished records to (trainer nodes but its own)
    topo.remote_pullers        # rollout ranks that pull some weights over the network
    print(topo.describe())     # the role table printed at start

Trainer ranks may sit on any node: one FSDP2 group over all of them, or with ``replicated``
(--cluster.sharding hsdp) sharded within each node and replicated across nodes (then every trainer
node has the same number of trainer ranks, ``shard_size``).

Node identity is torchrun's (GROUP_RANK of each agent, gathered from every rank), never the
hostname: two torchrun agents on one machine are two nodes, so every cross-node path runs on a
laptop. Ranks on one node share /dev/shm and GPUs by CUDA IPC; ranks on different nodes talk only
over TCP (the control plane, record shipping, weight pulls).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from staleflow.cluster.roles import Roles
from staleflow.config import ConfigError


@dataclass(frozen=True)
class Topology:
    roles: Roles
    nodes: tuple[int, ...]
    """Node (torchrun's GROUP_RANK) of every global rank."""
    local_ranks: tuple[int, ...]
    addrs: dict[int, str] = field(default_factory=dict)
    """The address each node binds its servers to (the interface that reaches the rendezvous host)."""
    replicated: bool = False
    """HSDP (--cluster.sharding hsdp): the trainer shards within each node and replicates across nodes,
    so every trainer node holds every weight; FSDP (False): one group shards over every trainer rank."""

    @classmethod
    def from_ranks(
        cls, roles: Roles, nodes, local_ranks, addrs: dict[int, str] | None = None, replicated: bool = False
    ) -> Topology:
        if len(nodes) != roles.world_size or len(local_ranks) != roles.world_size:
            raise ValueError(f"topology of {len(nodes)} ranks for a world of {roles.world_size}")
        nodes, local = tuple(int(n) for n in nodes), tuple(int(r) for r in local_ranks)
        return cls(roles, nodes, local, dict(addrs or {}), bool(replicated))

    @classmethod
    def single_node(cls, roles: Roles, replicated: bool = False) -> Topology:
        n = roles.world_size
        return cls(roles, (0,) * n, tuple(range(n)), {}, replicated)

    # ---- where things are --------------------------------------------------------------------
    @property
    def home(self) -> int:
        """The node of global rank 0: the controller and the trainer leader."""
        return self.nodes[0]

    @property
    def node_ids(self) -> list[int]:
        return sorted(set(self.nodes))

    @property
    def multi_node(self) -> bool:
        return len(self.node_ids) > 1

    def node_of(self, rank: int) -> int:
        return self.nodes[rank]

    def same_node(self, a: int, b: int) -> bool:
        return self.nodes[a] == self.nodes[b]

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    @property
    def trainer_nodes(self) -> list[int]:
        return sorted({self.nodes[r] for r in self.roles.trainer_ranks})

    def trainers_on(self, node: int) -> list[int]:
        return [r for r in self.roles.trainer_ranks if self.nodes[r] == node]

    @property
    def shard_size(self) -> int:
        """Ranks one copy of the weights is sharded over: every trainer rank (FSDP), or each trainer
        node's (HSDP, the same on every trainer node: ``validate``)."""
        if not self.replicated:
            return self.roles.num_trainer
        return len(self.trainers_on(self.home))

    @property
    def full_nodes(self) -> list[int]:
        """Nodes whose Parameter Server pieces hold every weight: the trainer node of a run whose
        trainers share one node, or every trainer node under HSDP; none for FSDP across nodes."""
        nodes = self.trainer_nodes
        return nodes if self.replicated or len(nodes) == 1 else []

    def ships_to(self, rank: int) -> list[int]:
        """Nodes that need a rollout rank's finished records: every trainer node (the home node,
        where the controller scores them, is one) other than the rank's own."""
        return [n for n in self.trainer_nodes if n != self.nodes[rank]]

    def receiver_rank(self, node: int) -> int | None:
        """The rank hosting a node's record receiver: its first trainer rank (None: no trainer there)."""
        return next((r for r in self.roles.trainer_ranks if self.nodes[r] == node), None)

    @property
    def remote_pullers(self) -> list[int]:
        """Rollout ranks that do not read every weight from the home node's Parameter Server: those off
        the home node, and all of them when the home node does not hold every piece (FSDP across nodes).
        A rank on another node that holds every piece (HSDP) reads its own node's; an engine whose worker
        maps the home node's slots itself (vLLM) runs only on the others (``check_placement``). Which
        pieces cross the network is the copy plan's (cluster/placement.py)."""
        home_full = self.home in self.full_nodes
        return [r for r in self.roles.rollout_ranks if self.nodes[r] != self.home or not home_full]

    @property
    def rollout_nodes(self) -> list[int]:
        return sorted({self.nodes[r] for r in self.roles.rollout_ranks})

    @property
    def fetches_partials(self) -> bool:
        """Rollout ranks on two or more nodes: a partial trajectory may resume on another node than
        the one holding its record, so rollout ranks serve their records on request."""
        return len(self.rollout_nodes) > 1

    # ---- checks and the table ----------------------------------------------------------------
    def validate(self, engine=None) -> None:
        """Refuse layouts this version cannot run, in one line naming the fix; ``engine``: the run's
        rollout-engine backend (staleflow.engines), which may refuse more (``check_placement``)."""
        if self.replicated:
            counts = {n: len(self.trainers_on(n)) for n in self.trainer_nodes}
            if len(set(counts.values())) > 1:
                said = ", ".join(f"node {n}: {k}" for n, k in counts.items())
                raise ConfigError(
                    f"--cluster.sharding hsdp replicates the trainer across nodes, so every trainer node needs the "
                    f"same number of trainer ranks ({said}); change --rollout.ranks or use --cluster.sharding fsdp"
                )
        if engine is not None:
            engine.check_placement(self)

    def describe(self, controller: str = "") -> str:
        """One line per node: its ranks and their roles (printed by rank 0 at start)."""
        r = self.roles
        n_nodes = len(self.node_ids)
        at = f" ({controller})" if controller else ""
        where = f"controller and Parameter Server on node {self.home}{at}"
        if len(self.trainer_nodes) > 1:
            sharding = "HSDP: sharded within a node, replicated across" if self.replicated else "FSDP over all"
            where = (
                f"controller on node {self.home}{at}; trainers ({sharding}) and Parameter Server pieces on nodes "
                f"{', '.join(map(str, self.trainer_nodes))}"
            )
        head = (
            f"staleflow: {r.world_size} ranks on {n_nodes} node{'s' if n_nodes > 1 else ''} "
            f"({r.num_trainer} trainer, {r.num_rollout} rollout); {where}"
        )
        lines = [head]
        for node in self.node_ids:
            parts = []
            for rank in self.ranks_on(node):
                if r.role(rank) == "trainer":
                    parts.append(f"rank {rank} trainer{' (leader)' if rank == 0 else ''}")
                else:
                    parts.append(f"rank {rank} rollout {r.instance_id(rank)}")
            addr = f" [{self.addrs[node]}]" if self.multi_node and node in self.addrs else ""
            lines.append(f"  node {node}{addr}: " + ", ".join(parts))
        return "\n".join(lines)


def gather_topology(roles: Roles, node_rank: int, local_rank: int, addr: str, replicated: bool = False) -> Topology:
    """Every rank's (node, local rank, bind address), gathered over the world group (a collective)."""
    from staleflow.cluster.exchange import all_gather_json

    got = all_gather_json([int(node_rank), int(local_rank), str(addr)])
    addrs = {}
    for node, _, a in got:
        addrs.setdefault(node, a)
    return Topology.from_ranks(roles, [g[0] for g in got], [g[1] for g in got], addrs, replicated)
