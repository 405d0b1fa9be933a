"""The memory plan of a run: per rank and per GPU, from the runtime's own objects on the meta device.

    python -m staleflow plan --preset gpu-7b --gpu-memory-gib 80          # 8 processes, 4 rollout
    plan = build_plan(cfg, nproc=8, gpu_bytes=80 << 30)                   # RunPlan
    plan.fits, plan.per_gpu, plan.advice(), plan.gpu_share[rank]

Each rank's entry (estimate.py) is built from what the rank really allocates: our CausalLM in
the trainer's master dtype and FSDP2's shard rule, the AdamW state, the Parameter Server layout
in the slot dtype split into the pieces placement.py places on the trainer GPUs, the built-in
engine's KV cache (each rollout rank's rows come from its engine backend, staleflow.engines);
activations from the bytes autograd saves for one of our
decoder layers. A run on CUDA prints the plan at start and refuses to start when a GPU would
overflow (launch/entry.py), naming the flag to change. docs/memory-plan.md explains every column.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from staleflow.cluster.placement import gpu_of, slot_dtype, slot_placement
from staleflow.plan.estimate import PRIMARY_CONTEXT_BYTES, RankPlan, rollout_rank, trainer_rank
from staleflow.plan.nodes import add_pull_contexts, plan_topology, shard_of, update_traffic

__all__ = ["RankPlan", "RunPlan", "at_start", "build_plan"]


@dataclass
class RunPlan:
    model: str
    params: int
    device_type: str
    gpu_bytes: int
    num_gpus: int
    ranks: list[RankPlan]
    per_gpu: dict[int, int] = field(default_factory=dict)
    kv_tokens: int = 0
    """--rollout.max-kv-tokens: each rollout rank's KV capacity."""
    engine: str = "builtin"
    """--rollout.engine: the backend that planned the rollout ranks."""
    gpu_share: dict[int, float] = field(default_factory=dict)
    """On CUDA, for each rollout rank whose engine backend takes_gpu_share: the share of its GPU the
    engine may use (its planned bytes / GPU bytes, without the rank process's own context)."""
    active_params: int = 0
    """Parameters one token runs through (a mixture-of-experts layer runs k of its E experts);
    equal to ``params`` for a dense model. Memory follows ``params``, compute ``active_params``."""
    nodes: int = 1
    node_of: dict[int, int] = field(default_factory=dict)
    """Each rank's node (ranks numbered node by node, trainer ranks first)."""
    sharding: str = "fsdp"
    """--cluster.sharding: the trainer's FSDP over all trainer ranks, or HSDP (replicas across nodes)."""
    update_cross_bytes: int = 0
    """Bytes one weight update moves between nodes (every rollout instance pulls every piece once)."""
    update_sent_by_node: dict[int, int] = field(default_factory=dict)
    """... of which each node's Parameter Server pieces send (node -> bytes)."""

    @property
    def per_node(self) -> dict[int, int]:
        """The peaks of each node's ranks together (its GPUs' memory on CUDA, its host memory on CPU)."""
        out: dict[int, int] = {}
        for rp in self.ranks:
            if rp.rank >= 0:
                out[self.node_of.get(rp.rank, 0)] = out.get(self.node_of.get(rp.rank, 0), 0) + rp.peak
        return dict(sorted(out.items()))

    @property
    def fits(self) -> bool:
        return self.device_type != "cuda" or max(self.per_gpu.values(), default=0) <= self.gpu_bytes

    def advice(self) -> str:
        from staleflow.plan.report import advice

        return advice(self)


def build_plan(
    cfg,
    nproc: int,
    gpu_bytes: int,
    device_type: str = "cuda",
    num_gpus: int | None = None,
    flash: bool | None = None,
    nodes: int = 1,
) -> RunPlan:
    """The plan of ``cfg`` run by ``nproc`` processes in all, on ``nodes`` nodes of ``num_gpus`` GPUs of
    ``gpu_bytes`` each (one per process by default; a node's ranks share its GPUs round-robin as
    launch/dist.py assigns them). GPUs are numbered node by node (node k's GPU g is k * num_gpus + g).
    Rollout ranks off the first node pull weights over NCCL (one group each with the slot piece
    owners: NCCL_PULL_BYTES on every member); the others map the slots by CUDA IPC."""
    if nodes < 1 or nproc % nodes:
        raise ValueError(f"{nproc} processes do not split evenly over {nodes} nodes")
    from staleflow.cluster.roles import Roles
    from staleflow.engines import engine_backend
    from staleflow.model.attention import _flash_available
    from staleflow.plan.architecture import meta_model, model_args
    from staleflow.servers.layout import ParamLayout
    from staleflow.train.parallelize import MASTER_DTYPE

    roles = Roles(nproc, cfg.rollout.ranks)
    per_node = nproc // nodes
    topo = plan_topology(cfg, nproc, nodes)
    topo.validate()
    gpus = num_gpus or per_node
    cuda = device_type == "cuda"
    flash = _flash_available() if flash is None else flash
    args = model_args(cfg.model.path)
    master = meta_model(args, MASTER_DTYPE)
    place = slot_placement(topo, device_type)
    pushed = master.named_parameters()
    if cfg.lora.enabled:  # the slots hold the adapted projections' merged weights only (Trainer.pushed)
        from staleflow.train.lora import lora_targets

        params = dict(master.named_parameters())
        pushed = [(f"{m}.weight", params[f"{m}.weight"]) for m in lora_targets(master, cfg.lora.targets)]
    layout = ParamLayout.from_named_tensors(pushed, dtype=slot_dtype(cfg, device_type))
    ranks: list[RankPlan] = []
    for r in roles.trainer_ranks:  # CUDA: its own piece; CPU: its node's piece, in the node leader's shared memory
        owned = [spec for spec in place.pieces if spec.owner == r]
        slots = 2 * sum(layout.piece(spec).nbytes for spec in owned)
        shard, shards = shard_of(topo, r)
        rp = trainer_rank(cfg, args, shard, shards, device_type, slots, flash, lm=master)
        ranks.append(dataclasses.replace(rp, rank=r))
    base = None  # every rollout rank runs the same engine on the same model: planned once, copied
    for r in roles.rollout_ranks:
        base = base or rollout_rank(cfg, args, r, device_type)
        ranks.append(dataclasses.replace(base, rank=r, items=dict(base.items), notes=list(base.notes)))
    from staleflow.plan.reward_model import reward_model_ranks

    reward = reward_model_ranks(cfg, device_type)  # --reward.model's processes (rank -1, -2, ...)
    plan = RunPlan(
        cfg.model.path,
        sum(p.numel() for p in master.parameters()),
        device_type,
        gpu_bytes,
        gpus if cuda else 0,
        ranks + reward,
        kv_tokens=cfg.rollout.max_kv_tokens,
        engine=cfg.rollout.engine,
        active_params=master.num_active_params(),
        nodes=nodes,
        node_of={r: topo.node_of(r) for r in range(nproc)},
        sharding=cfg.cluster.sharding,
    )
    plan.update_cross_bytes, plan.update_sent_by_node = update_traffic(topo, place, layout)
    if not cuda:
        return plan

    def gpu(rank: int) -> int:
        node = rank // per_node
        return node * gpus + gpu_of(rank - node * per_node, gpus)

    for rp in ranks:
        rp.gpu = gpu(rp.rank)
    ranks = ranks + [rp for rp in reward if rp.gpu is not None]  # a reward model on cuda:N shares GPU N
    add_pull_contexts(ranks, topo, place, gpu)
    for rp in ranks:
        plan.per_gpu[rp.gpu] = plan.per_gpu.get(rp.gpu, 0) + rp.peak
    if engine_backend(cfg).takes_gpu_share:
        for rp in ranks:
            if rp.role == "rollout":
                engine = rp.steady - PRIMARY_CONTEXT_BYTES  # the rank process's own context is not the engine's
                cap = (gpu_bytes - PRIMARY_CONTEXT_BYTES) / gpu_bytes
                plan.gpu_share[rp.rank] = min(round(engine / gpu_bytes + 0.005, 2), round(cap - 0.005, 2))
    return plan


def at_start(cfg, world_size: int) -> str:
    """Rank 0 of a run, before anything is allocated: print the plan (stderr) for this node's GPUs
    (or host memory on CPU) and return "" or, on CUDA when a GPU would overflow, the one-line
    refusal naming the flag to change. A plan that cannot be built is reported, never fatal."""
    import os
    import sys

    import torch

    from staleflow.plan.report import json_line, table

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    try:
        plan = build_plan(
            cfg,
            world_size,
            torch.cuda.get_device_properties(0).total_memory if cuda else 0,
            device_type="cuda" if cuda else "cpu",
            num_gpus=torch.cuda.device_count() if cuda else None,
            nodes=max(1, world_size // local) if world_size % local == 0 else 1,
        )
    except Exception as e:  # the plan informs; a model it cannot describe must not stop the run
        print(f"staleflow: memory plan unavailable ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return ""
    print(f"{table(plan)}\n{json_line(plan)}", file=sys.stderr, flush=True)
    return plan.advice()
