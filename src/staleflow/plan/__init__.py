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
from collections import Counter
from dataclasses import dataclass, field

from staleflow.cluster.placement import gpu_of, slot_dtype, slot_placement
from staleflow.plan.estimate import (
    NCCL_PULL_BYTES,
    PEER_CONTEXT_BYTES,
    PRIMARY_CONTEXT_BYTES,
    RankPlan,
    rollout_rank,
    trainer_rank,
)

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
    gpus = num_gpus or per_node
    cuda = device_type == "cuda"
    flash = _flash_available() if flash is None else flash
    args = model_args(cfg.model.path)
    master = meta_model(args, MASTER_DTYPE)
    place = slot_placement(roles.num_trainer, nproc, device_type)
    pushed = master.named_parameters()
    if cfg.lora.enabled:  # the slots hold the adapted projections' merged weights only (Trainer.pushed)
        from staleflow.train.lora import lora_targets

        params = dict(master.named_parameters())
        pushed = [(f"{m}.weight", params[f"{m}.weight"]) for m in lora_targets(master, cfg.lora.targets)]
    layout = ParamLayout.from_named_tensors(pushed, dtype=slot_dtype(cfg, device_type))
    pieces = layout.split(place.pieces)
    ranks: list[RankPlan] = []
    for r in roles.trainer_ranks:
        slots = 2 * pieces[r].nbytes if cuda else (2 * layout.nbytes if r == 0 else 0)
        ranks.append(trainer_rank(cfg, args, r, roles.num_trainer, device_type, slots, flash, lm=master))
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
    )
    if not cuda:
        return plan

    def gpu(rank: int) -> int:
        node = rank // per_node
        return node * gpus + gpu_of(rank - node * per_node, gpus)

    for rp in ranks:
        rp.gpu = gpu(rp.rank)
    ranks = ranks + [rp for rp in reward if rp.gpu is not None]  # a reward model on cuda:N shares GPU N
    remote = [r for r in roles.rollout_ranks if r >= per_node]
    local = [r for r in roles.rollout_ranks if r < per_node]
    # every local puller (a rollout rank, or its engine's own worker process) maps every slot piece by CUDA
    # IPC: one more context on each trainer GPU that is not its own
    piece_gpus = sorted({gpu(t) for t in roles.trainer_ranks})
    foreign = Counter(g for r in local for g in piece_gpus if g != gpu(r))
    for g, n in sorted(foreign.items()):
        owner = next(rp for rp in ranks if rp.gpu == g)
        owner.add("contexts", n * PEER_CONTEXT_BYTES, f"{n} pullers' IPC contexts on GPU {g}")
    for rp in ranks:
        if rp.role == "trainer" and remote:
            rp.add("contexts", len(remote) * NCCL_PULL_BYTES, f"{len(remote)} remote pullers' NCCL groups")
        elif rp.rank in remote:
            rp.add("contexts", NCCL_PULL_BYTES, "its weight-pull NCCL group with the slot piece owners")
        elif rp.role == "trainer":
            rp.notes.append(
                f"contexts: no remote pullers (each rollout rank on another node adds {NCCL_PULL_BYTES >> 20} MiB "
                f"of NCCL group here: plan it with --nodes)"
            )
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
