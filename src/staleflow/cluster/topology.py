"""Which rank runs on which node, and what therefore crosses the network (pure, no torch).

    topo = Topology.from_ranks(roles, nodes=[0, 0, 1, 1], local_ranks=[0, 1, 0, 1], addrs={0: "10.0.0.1", 1: ...})
    topo.home                  # node of global rank 0: controller, trainer leader, Parameter Server
    topo.ships_to(rank)        # nodes a rollout rank sends its finished records to (trainer nodes but its own)
    topo.remote_pullers        # rollout ranks that pull weights over the network (not on the home node)
    print(topo.describe())     # the role table printed at start

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

    @classmethod
    def from_ranks(cls, roles: Roles, nodes, local_ranks, addrs: dict[int, str] | None = None) -> Topology:
        if len(nodes) != roles.world_size or len(local_ranks) != roles.world_size:
            raise ValueError(f"topology of {len(nodes)} ranks for a world of {roles.world_size}")
        return cls(roles, tuple(int(n) for n in nodes), tuple(int(r) for r in local_ranks), dict(addrs or {}))

    @classmethod
    def single_node(cls, roles: Roles) -> Topology:
        n = roles.world_size
        return cls(roles, (0,) * n, tuple(range(n)), {})

    # ---- where things are --------------------------------------------------------------------
    @property
    def home(self) -> int:
        """The node of global rank 0: the controller, the trainer leader and the Parameter Server."""
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

    def ships_to(self, rank: int) -> list[int]:
        """Nodes that need a rollout rank's finished records: every trainer node (the home node,
        where the controller scores them, is one) other than the rank's own."""
        return [n for n in self.trainer_nodes if n != self.nodes[rank]]

    def receiver_rank(self, node: int) -> int | None:
        """The rank hosting a node's record receiver: its first trainer rank (None: no trainer there)."""
        return next((r for r in self.roles.trainer_ranks if self.nodes[r] == node), None)

    @property
    def remote_pullers(self) -> list[int]:
        """Rollout ranks off the home node: they pull weights over the network."""
        return [r for r in self.roles.rollout_ranks if self.nodes[r] != self.home]

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
        off = [r for r in self.roles.trainer_ranks if self.nodes[r] != self.home]
        if off:
            per_node = self.nodes.count(self.home)
            raise ConfigError(
                f"trainer ranks {off} are not on node {self.home} with trainer rank 0: the Parameter Server's slots "
                f"live on one node, so every trainer rank must be there; raise --rollout.ranks to at least "
                f"{self.roles.world_size - per_node} (at most {per_node} trainer ranks on the first node)"
            )
        if engine is not None:
            engine.check_placement(self)

    def describe(self, controller: str = "") -> str:
        """One line per node: its ranks and their roles (printed by rank 0 at start)."""
        r = self.roles
        n_nodes = len(self.node_ids)
        head = (
            f"staleflow: {r.world_size} ranks on {n_nodes} node{'s' if n_nodes > 1 else ''} "
            f"({r.num_trainer} trainer, {r.num_rollout} rollout); controller and Parameter Server on node "
            f"{self.home}{f' ({controller})' if controller else ''}"
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


def gather_topology(roles: Roles, node_rank: int, local_rank: int, addr: str) -> Topology:
    """Every rank's (node, local rank, bind address), gathered over the world group (a collective)."""
    from staleflow.cluster.exchange import all_gather_json

    got = all_gather_json([int(node_rank), int(local_rank), str(addr)])
    addrs = {}
    for node, _, a in got:
        addrs.setdefault(node, a)
    return Topology.from_ranks(roles, [g[0] for g in got], [g[1] for g in got], addrs)
