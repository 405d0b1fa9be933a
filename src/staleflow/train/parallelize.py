"""How the trainer's model is parallelised and in which dtypes: one place, read by the trainer and
by the memory plan (staleflow.plan), so a change here changes both.

    mesh = trainer_mesh(group, "cuda", replicas)   # FSDP2 over the group, or HSDP (Replicas)
    shard_policy(policy, mesh, "cuda")   # FSDP2: one unit per decoder layer + the root
    mixed_precision("cuda").param_dtype  # bf16 compute, fp32 gradient reduction
    MASTER_DTYPE                         # fp32 master weights, gradients, AdamW state
    fill_parameters(model, weights, dev)  # a sharded meta model, materialised: each rank its rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASTER_DTYPE = torch.float32
"""Dtype of the trainer's (sharded) master weights, gradients and AdamW state."""


@dataclass(frozen=True)
class Replicas:
    """HSDP (--cluster.sharding hsdp): each node's trainer ranks shard the weights among themselves and
    the nodes hold replicas, kept equal by an all-reduce of the gradients between them. ``rows``: the
    trainer ranks (global ranks), one row per trainer node; rank ``rows[i][s]`` holds chunk s of every
    dim-0-sharded tensor, like ``rows[j][s]`` on every other node. The groups are this rank's: its node's
    row (``shard_group``) and its column (``replicate_group``), made by launch/dist.make_groups."""

    rows: tuple[tuple[int, ...], ...]
    shard_group: object
    replicate_group: object

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, shard index) of a trainer rank."""
        for i, row in enumerate(self.rows):
            if rank in row:
                return i, row.index(rank)
        raise ValueError(f"rank {rank} is not in the HSDP mesh {self.rows}")


def trainer_mesh(group, device_type: str, replicas: Replicas | None = None):
    """The DeviceMesh FSDP2 shards over: 1-D over the trainer group (FSDP), or 2-D (replicate, shard)
    from the HSDP groups (fully_shard then shards along the second dimension and replicates along
    the first)."""
    from torch.distributed.device_mesh import DeviceMesh

    if replicas is None:
        return DeviceMesh.from_group(group, device_type)
    return DeviceMesh.from_group(
        [replicas.replicate_group, replicas.shard_group],
        device_type,
        mesh=torch.tensor(replicas.rows, dtype=torch.int),
        mesh_dim_names=("replicate", "shard"),
    )


def mixed_precision(device_type: str):
    """FSDP2's MixedPrecisionPolicy for a device type: bf16 compute with fp32 reduction on CUDA,
    the master dtype everywhere on CPU (exact tests)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def compute_dtype(device_type: str, setting: str = "auto") -> torch.dtype:
    """The dtype the forward runs in (--train.compute-dtype): auto = bf16 on CUDA (FSDP2
    param_dtype or autocast), the master's on CPU (exact); bfloat16 on CPU autocasts the decoder
    (CPUs with AVX512-BF16 / AMX run it ~2x faster; docs/perf.md) with the LM head kept in fp32."""
    if setting == "float32":
        return MASTER_DTYPE
    if setting == "bfloat16":
        return torch.bfloat16
    if setting != "auto":
        raise ValueError(f"--train.compute-dtype={setting!r} is invalid: use auto, float32 or bfloat16")
    return torch.bfloat16 if device_type == "cuda" else MASTER_DTYPE


def activation_checkpointing_on(setting: str | bool, device_type: str) -> bool:
    """--train.activation-checkpointing: auto = on for CUDA (activations dominate there), off on CPU."""
    if setting in (True, "on"):
        return True
    if setting in (False, "off"):
        return False
    if setting == "auto":
        return device_type == "cuda"
    raise ValueError(f"--train.activation-checkpointing={setting!r} is invalid: use auto, on or off")


def shard_policy(policy, mesh, device_type: str) -> None:
    """FSDP2 over ``mesh``: one unit per decoder layer, the root (embeddings, final norm, LM head)
    on the PolicyHead; ``mixed_precision(device_type)``. The memory plan's tests shard a meta-device
    policy with this same function.

    A mixture-of-experts layer is two units: its experts (``mlp.experts``, nearly all of its bytes:
    1.2 GB of 1.24 in bf16 at Qwen3-30B-A3B's width) and the rest (attention, norms, router). The
    layer's forward prefetches its experts (``set_modules_to_forward_prefetch``), so their all-gather
    runs while the attention computes instead of after it. Every expert's weights are sharded along
    dim 0 over all trainer ranks, like any other weight: each rank holds 1/W of every expert (no
    expert parallelism; tokens never move between ranks)."""
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision(device_type)
    for layer in policy.lm.model.layers:
        sparse = getattr(layer, "sparse", False)
        if sparse:
            fully_shard(layer.mlp.experts, mesh=mesh, mp_policy=mp)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
        if sparse:
            layer.set_modules_to_forward_prefetch([layer.mlp.experts])
    fully_shard(policy, mesh=mesh, mp_policy=mp)


def fill_parameters(model, weights, device, partial: bool = False) -> None:
    """Copy the rows of each (name, full tensor) in ``weights`` that this rank keeps into the
    model's parameter of that name (sharded by FSDP2 or not; materialised, e.g. by to_empty).

    Every rank reads each full tensor and keeps its own rows (no communication), one tensor at a
    time, so no rank ever holds the whole model. Every parameter must be given exactly once
    (``partial``: at most once, e.g. only the LoRA adapters)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        for name, full in weights:
            p = params.get(name)
            if p is None:
                raise ValueError(f"weights: {name!r} is not a parameter of the {type(model).__name__}")
            if name in filled:
                raise ValueError(f"weights: {name!r} was given twice")
            if tuple(full.shape) != tuple(p.shape):  # a DTensor's shape is the global one
                raise ValueError(f"weights: {name!r} has shape {tuple(full.shape)}, the parameter {tuple(p.shape)}")
            full = full.to(device, MASTER_DTYPE)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p = p.to_local()
            p.copy_(full)
            filled.add(name)
    missing = sorted(set(params) - filled)
    if missing and not partial:
        raise ValueError(f"weights: {len(missing)} parameters were never given, e.g. {missing[:3]}")
