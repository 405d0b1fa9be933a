"""Weight transports of the Parameter Server besides CPU shared memory.

- CUDA IPC: the slots are flat uint8 tensors on a GPU, allocated by the leader. Their IPC
  handles (``torch.multiprocessing.reductions.reduce_tensor``) are written into the slot
  segments so any process of the node can map them and copy device-to-device. The
  creating process keeps the tensors alive for the lifetime of the server.
- Broadcast: ``broadcast_pull`` moves a pulled version from one rank to a whole process
  group (NCCL on GPU, gloo on CPU), coalesced per dtype into buckets, for instances that
  pull together or live on other nodes.
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist

# Slot tensors owned by this process, by segment name: a process cannot open its own IPC handle.
_LOCAL_CUDA_SLOTS: dict[str, torch.Tensor] = {}


def cuda_slot_create(seg_name: str, nbytes: int, device: torch.device) -> tuple[torch.Tensor, bytes]:
    """Allocate a slot on ``device`` and return it with its serialised IPC handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    slot = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    _LOCAL_CUDA_SLOTS[seg_name] = slot
    rebuild, args = reduce_tensor(slot)
    # Our own bytes, written by our own process into our own segment: pickle is safe here.
    return slot, pickle.dumps((os.getpid(), rebuild, args))


def cuda_slot_open(seg_name: str, blob: bytes) -> torch.Tensor:
    """Map a slot created by ``cuda_slot_create`` (in this or another process of the node)."""
    local = _LOCAL_CUDA_SLOTS.get(seg_name)
    if local is not None:
        return local
    pid, rebuild, args = pickle.loads(blob)
    if pid == os.getpid():
        raise RuntimeError(f"slot {seg_name} was created by this process but is no longer alive here")
    return rebuild(*args)


def cuda_slot_release(seg_name: str) -> None:
    _LOCAL_CUDA_SLOTS.pop(seg_name, None)


def sync_device(device: torch.device) -> None:
    """Wait for queued copies on ``device`` (a stamp check is only meaningful after them)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def broadcast_pull(group, src_rank: int, tensors: dict[str, torch.Tensor],
                   bucket_bytes: int = 64 << 20) -> dict[str, torch.Tensor]:
    """Broadcast ``tensors`` from global rank ``src_rank`` to every rank of ``group``, in place.

    Every rank passes tensors with the same names, shapes and dtypes (e.g. ``layout.empty()``);
    on ``src_rank`` they hold the version it pulled from the Parameter Server. Tensors are
    sent in name order, coalesced per dtype into buckets of about ``bucket_bytes``.
    """
    if not dist.is_initialized():
        raise RuntimeError("broadcast_pull needs torch.distributed initialised (torchrun + init_process_group)")
    names = sorted(tensors)
    is_src = dist.get_rank() == src_rank
    bucket: list[torch.Tensor] = []

    def flush():
        if not bucket:
            return
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.broadcast(bucket[0], src=src_rank, group=group)
        else:
            flat = (torch.cat([t.reshape(-1) for t in bucket]) if is_src
                    else torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device))
            dist.broadcast(flat, src=src_rank, group=group)
            if not is_src:
                pos = 0
                for t in bucket:
                    t.copy_(flat[pos:pos + t.numel()].view(t.shape))
                    pos += t.numel()
        bucket.clear()

    size = 0
    for name in names:
        t = tensors[name]
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device
                       or size + t.numel() * t.element_size() > bucket_bytes):
            flush()
            size = 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    flush()
    return tensors
