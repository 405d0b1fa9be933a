"""Where the run's memory goes: the one place that decides it, read by the runtime, the plan and the
simulator.

    place = slot_placement(topo, "cuda")          # a PieceSpec per trainer GPU (one per trainer node on CPU)
    place.pieces[p].owner, place.pieces[p].node    # who allocates, writes and serves piece p, and where
    place.pull_plan(node=1, puller=5)              # the pieces rollout rank 5 on node 1 copies, one per row range
    place.bytes_by_node(layout, node=1, puller=5)  # ... and how many bytes each node sends it
    reader_index(rank=5, world_size=8)   # 5: a rollout rank that pulls itself (built-in engine)
    reader_index(5, 8, engine_worker=True)   # 13: the worker process of that rank's vLLM engine
    slot_dtype(cfg, "cuda")              # what the slots hold: the rollout engines' dtype (bf16)
    gpu_of(rank, num_gpus)               # launch/dist.pick_device's choice, as an index
    ps_egress_gb_s(trainer_gpus=40)      # the simulator's Parameter Server egress: 40 owners' NICs on 5 nodes

Parameter-server slots are sharded like the trainer (servers/layout.PieceSpec). With FSDP over all
trainer ranks, piece p holds the rows FSDP2 gives its ranks: on CUDA one piece per trainer rank on
that rank's GPU, on CPU one piece per trainer node in that node's shared memory (its ranks' rows,
contiguous because torchrun numbers a node's ranks consecutively). With HSDP (--cluster.sharding
hsdp: shard within a node, replicate across nodes) every trainer node holds every row, so pieces
with the same rows are replicas. Each trainer node's first trainer rank (its node leader) creates
that node's slots; a weight update never funnels through one node.

A puller's copy plan takes one piece per row range: the one on its own node where there is one
(shared memory on CPU, CUDA IPC on GPU), else a replica on another node chosen by the puller's rank
(spreading the pullers over the replicas), sent by its owner over gloo/NCCL. Readers need their own
IPC handle each: a rollout rank uses its global rank, the worker process of its vLLM engine (another
process) world_size + rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.cluster.roles import Roles
from staleflow.cluster.topology import Topology
from staleflow.config import ConfigError
from staleflow.shards import PieceSpec


@dataclass(frozen=True)
class SlotPlacement:
    device_type: str
    pieces: tuple[PieceSpec, ...]
    """Every piece of a slot, in owner-rank order; a piece's index is its position here."""
    readers: int
    """IPC reader indices each GPU piece carries (0 on CPU: shared memory needs none)."""

    def owner(self, piece: int) -> int:
        """The rank that allocates, writes and serves ``piece``."""
        return self.pieces[piece].owner

    @property
    def owners(self) -> list[int]:
        return sorted({p.owner for p in self.pieces})

    @property
    def nodes(self) -> list[int]:
        """The nodes holding pieces (the trainer nodes)."""
        return sorted({p.node for p in self.pieces})

    def on_node(self, node: int) -> list[int]:
        """Indices of the pieces held on ``node``."""
        return [i for i, p in enumerate(self.pieces) if p.node == node]

    def node_leader(self, node: int) -> int | None:
        """The rank that creates ``node``'s slots: its first piece owner (its first trainer rank)."""
        here = self.on_node(node)
        return self.pieces[here[0]].owner if here else None

    def ranges(self) -> list[tuple[int, int]]:
        """The distinct row ranges (lo, hi) of the pieces, in order: each puller copies each once."""
        return list(dict.fromkeys((p.lo, p.hi) for p in self.pieces))

    def holds_all(self, node: int) -> bool:
        """``node`` holds every row range (a single trainer node, or any trainer node under HSDP)."""
        return {(self.pieces[i].lo, self.pieces[i].hi) for i in self.on_node(node)} == set(self.ranges())

    def pull_plan(self, node: int, puller: int) -> list[int]:
        """The pieces a puller (rank ``puller`` on ``node``) copies: one per row range, its own node's
        where it holds that range, else replica ``puller % replicas`` on another node."""
        plan = []
        for lo, hi in self.ranges():
            replicas = [i for i, p in enumerate(self.pieces) if (p.lo, p.hi) == (lo, hi)]
            here = [i for i in replicas if self.pieces[i].node == node]
            plan.append(here[0] if here else replicas[puller % len(replicas)])
        return plan

    def remote_owners(self, node: int, puller: int) -> list[int]:
        """Ranks that send this puller pieces over the network (its plan's owners on other nodes)."""
        return sorted({self.pieces[i].owner for i in self.pull_plan(node, puller) if self.pieces[i].node != node})

    def bytes_by_node(self, layout, node: int, puller: int) -> dict[int, int]:
        """Bytes of one pull by the node that holds them (the puller's own node: a local copy)."""
        out: dict[int, int] = {}
        for i in self.pull_plan(node, puller):
            p = self.pieces[i]
            out[p.node] = out.get(p.node, 0) + layout.piece_bytes(p)
        return out


def slot_placement(topo: Topology, device_type: str, hsdp: bool | None = None) -> SlotPlacement:
    """The slots' pieces of a run laid out as ``topo`` (``hsdp``: default ``topo.replicated``)."""
    hsdp = topo.replicated if hsdp is None else hsdp
    by_node: dict[int, list[int]] = {}
    for r in topo.roles.trainer_ranks:
        by_node.setdefault(topo.node_of(r), []).append(r)
    cuda = device_type == "cuda"
    pieces: list[PieceSpec] = []
    if hsdp:
        shards = topo.shard_size
        for node, ranks in by_node.items():
            if cuda:
                pieces += [PieceSpec(r, node, i, i + 1, shards) for i, r in enumerate(ranks)]
            else:
                pieces.append(PieceSpec(ranks[0], node, 0, shards, shards))
    else:
        world = topo.roles.num_trainer
        for node, ranks in by_node.items():
            if ranks != list(range(ranks[0], ranks[-1] + 1)):
                raise ConfigError(
                    f"trainer ranks {ranks} of node {node} are not consecutive: torchrun numbers a node's ranks "
                    f"consecutively; start every node with the same --nproc-per-node"
                )
            if cuda:
                pieces += [PieceSpec(r, node, r, r + 1, world) for r in ranks]
            else:
                pieces.append(PieceSpec(ranks[0], node, ranks[0], ranks[-1] + 1, world))
    pieces.sort(key=lambda p: p.owner)
    return SlotPlacement(device_type, tuple(pieces), readers=2 * topo.roles.world_size if cuda else 0)


def cluster_placement(trainer_gpus: int, gpus_per_node: int = 8, hsdp: bool = False) -> SlotPlacement:
    """The runtime's placement of a cluster's trainer (CUDA, ``trainer_gpus`` trainer ranks first on
    nodes of ``gpus_per_node``, one rollout rank after them): what ``plan --nodes`` prints and what the
    simulator's Parameter Server egress assumes (``ps_egress_gb_s``)."""
    if trainer_gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"cluster_placement({trainer_gpus}, {gpus_per_node}): both must be >= 1")
    world = trainer_gpus + 1
    roles = Roles(world, 1)
    nodes = [r // gpus_per_node for r in range(world)]
    return slot_placement(Topology.from_ranks(roles, nodes, [r % gpus_per_node for r in range(world)]), "cuda", hsdp)


def ps_egress_gb_s(trainer_gpus: int, gpus_per_node: int = 8, nic_gb_s: float = 25.0) -> float:
    """Bandwidth the Parameter Server sends weight pulls with: each piece from its owner's GPU, through
    that GPU's NIC (``nic_gb_s``: one 200 Gb/s NIC per GPU), on every trainer node at once."""
    if trainer_gpus < 1:
        return 0.0
    return nic_gb_s * len(cluster_placement(trainer_gpus, gpus_per_node).owners)


def reader_index(rank: int, world_size: int, engine_worker: bool = False) -> int:
    """The IPC reader index of a pulling process: its rank, or world_size + rank for the worker
    process of that rank's vLLM engine."""
    return world_size + rank if engine_worker else rank


def slot_dtype(cfg, device_type: str):
    """The slots hold the weights in the rollout engines' dtype (a torch.dtype: --rollout.dtype, auto:
    bf16 on CUDA, fp32 on CPU): the trainer casts its fp32 shards once while writing, pullers copy as is.
    (torch is imported here only: the simulator reads this module's placement without it.)"""
    import torch

    from staleflow.rollout.builtin_engine import rollout_dtype

    return rollout_dtype(cfg.model, cfg.rollout, torch.device(device_type))


def gpu_of(rank: int, num_gpus: int) -> int:
    """The GPU index launch/dist.pick_device gives a rank of a single-node run (LOCAL_RANK = rank)."""
    return rank % num_gpus


def engine_visible_devices(
    own_gpu: int, piece_gpus: list[int], num_gpus: int, parent_visible: str | None = None
) -> str:
    """CUDA_VISIBLE_DEVICES for a rollout rank's vLLM engine while it starts: the rank's own GPU
    first (vLLM puts its single-GPU engine on the first visible device and checks free memory
    there), then the GPUs holding the slot pieces its worker maps by CUDA IPC. No other rollout
    rank's GPU is visible. Indices go through the parent's CUDA_VISIBLE_DEVICES, if set."""
    parent = [d.strip() for d in parent_visible.split(",")] if parent_visible else [str(i) for i in range(num_gpus)]
    order = [own_gpu] + [g for g in dict.fromkeys(piece_gpus) if g != own_gpu]
    return ",".join(parent[g] for g in order)
