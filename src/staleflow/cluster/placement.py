"""Where the run's memory goes: the one place that decides it, read by the runtime and the plan.

    place = slot_placement(num_trainer=4, world_size=8, device_type="cuda")
    place.pieces, place.readers          # 4 GPU pieces per slot (one per trainer GPU), 16 reader indices
    reader_index(rank=5, world_size=8)   # 5: a rollout rank that pulls itself (built-in engine)
    reader_index(5, 8, engine_worker=True)   # 13: the worker process of that rank's vLLM engine
    slot_dtype(cfg, "cuda")              # what the slots hold: the rollout engines' dtype (bf16)
    gpu_of(rank, num_gpus)               # launch/dist.pick_device's choice, as an index

Parameter-server slots: on CPU one shared-memory segment per slot (the leader's). On CUDA each
slot is split into one piece per trainer rank, on that rank's GPU (servers/pieces.py): every
trainer writes its FSDP2 shards into its own GPU, and the two slots cost each trainer GPU
2 x (model bytes in the slot dtype) / trainers instead of doubling the leader's memory.
Readers need their own IPC handle each: a rollout rank uses its global rank, the worker
process of its vLLM engine (another process) world_size + rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotPlacement:
    device_type: str
    pieces: int
    """Pieces per slot: one per trainer rank on CUDA (piece r on trainer rank r's GPU); 1 on CPU."""
    readers: int
    """IPC reader indices each GPU piece carries (0 on CPU: shared memory needs none)."""

    def owner(self, piece: int) -> int:
        """The trainer rank that allocates and writes ``piece``."""
        return piece


def slot_placement(num_trainer: int, world_size: int, device_type: str) -> SlotPlacement:
    if device_type == "cuda":
        return SlotPlacement("cuda", pieces=num_trainer, readers=2 * world_size)
    return SlotPlacement(device_type, pieces=1, readers=0)


def reader_index(rank: int, world_size: int, engine_worker: bool = False) -> int:
    """The IPC reader index of a pulling process: its rank, or world_size + rank for the worker
    process of that rank's vLLM engine."""
    return world_size + rank if engine_worker else rank


def slot_dtype(cfg, device_type: str) -> torch.dtype:
    """The slots hold the weights in the rollout engines' dtype (--rollout.dtype, auto: bf16 on
    CUDA, fp32 on CPU): the trainer casts its fp32 shards once while writing, pullers copy as is."""
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
