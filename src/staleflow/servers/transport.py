"""Weight transports of the Parameter Server besides CPU shared memory.

- CUDA IPC pieces: a slot piece is a flat uint8 tensor on the GPU of the trainer rank that owns
  it, allocated by that rank. Its owner shares it ONCE PER READER: torch counts exactly one
  consumer per share (`reduce_tensor` -> `_share_cuda_`: a reference counter set to 1, which the
  consumer decrements when it drops the mapping; while it is above 0 the owner's caching
  allocator keeps the block out of reuse). One handle opened by N processes would drop that
  counter to 0 after the first reader let go, and the owner could then reuse memory the
  others still read. So a piece carries one handle per reader index (servers/pieces.py).
  Handles name the GPU by its UUID, not by an index, so a process with another
  CUDA_VISIBLE_DEVICES order (a vLLM engine started on its own GPU first) maps the right one.
- Broadcast: ``broadcast_pull`` moves a pulled version from one rank to a whole process
  group (NCCL on GPU, gloo on CPU), coalesced per dtype into buckets, for instances that
  pull together or live on other nodes.
"""

from __future__ import annotations

import os

import msgspec
import torch
import torch.distributed as dist

from staleflow.servers.errors import ServerError

# Piece tensors owned by this process, by segment name: a process cannot open its own IPC handle.
_LOCAL_PIECES: dict[str, torch.Tensor] = {}
_STORAGE_DEVICE = 6  # position of storage_device in rebuild_cuda_tensor's arguments


class CudaHandle(msgspec.Struct, array_like=True, frozen=True):
    """One reader's CUDA IPC handle of a piece, as plain data: what ``reduce_tensor`` returns for
    ``rebuild_cuda_tensor``, with the three Python objects it holds (tensor class, storage class,
    dtype) written as names from a fixed list. It sits in a segment other local users might
    plant, so it is decoded as typed data (msgspec), never unpickled."""

    pid: int
    tensor_cls: str
    size: list[int]
    stride: list[int]
    offset: int
    storage_cls: str
    dtype: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    requires_grad: bool
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


def _classes() -> dict[str, type]:
    return {
        "Tensor": torch.Tensor,
        "Parameter": torch.nn.Parameter,
        "TypedStorage": torch.storage.TypedStorage,
        "UntypedStorage": torch.UntypedStorage,
    }


def encode_cuda_handle(pid: int, args: tuple) -> bytes:
    """``reduce_tensor(t)[1]`` of a CUDA tensor as bytes (CudaHandle)."""
    names = {v: k for k, v in _classes().items()}
    (
        tcls,
        size,
        stride,
        offset,
        scls,
        dtype,
        device,
        handle,
        ssize,
        soff,
        grad,
        rc_handle,
        rc_off,
        ev_handle,
        ev_sync,
    ) = args
    if tcls not in names or scls not in names:
        raise ServerError(f"cannot share a {tcls.__name__} over a {scls.__name__} by CUDA IPC")
    return msgspec.msgpack.encode(
        CudaHandle(
            pid,
            names[tcls],
            list(size),
            list(stride),
            int(offset),
            names[scls],
            str(dtype).removeprefix("torch."),
            int(device),
            bytes(handle),
            int(ssize),
            int(soff),
            bool(grad),
            bytes(rc_handle),
            int(rc_off),
            None if ev_handle is None else bytes(ev_handle),
            bool(ev_sync),
        )
    )


def decode_cuda_handle(blob: bytes) -> tuple[int, tuple]:
    """(creator pid, rebuild_cuda_tensor's arguments) of a CudaHandle; ServerError if malformed."""
    try:
        h = msgspec.msgpack.decode(blob, type=CudaHandle)
    except msgspec.DecodeError as e:
        raise ServerError(f"a CUDA IPC handle of a parameter-server piece is malformed ({e})") from None
    cls = _classes()
    dtype = getattr(torch, h.dtype, None)
    if h.tensor_cls not in cls or h.storage_cls not in cls or not isinstance(dtype, torch.dtype):
        raise ServerError(f"a CUDA IPC handle names unknown types ({h.tensor_cls}, {h.storage_cls}, {h.dtype})")
    return h.pid, (
        cls[h.tensor_cls],
        torch.Size(h.size),
        tuple(h.stride),
        h.offset,
        cls[h.storage_cls],
        dtype,
        h.device,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        h.requires_grad,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )


def device_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (its UUID; the index only where torch has no UUID)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"index-{torch.device(device).index or 0}"


def local_device_of(uuid: str) -> torch.device:
    """This process's index of the GPU ``uuid`` (CUDA_VISIBLE_DEVICES may order GPUs differently)."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return torch.device("cuda", i)
    raise ServerError(
        f"the GPU {uuid} holding a parameter-server piece is not visible in this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): make it visible"
    )


def cuda_piece_create(
    seg_name: str, nbytes: int, device: torch.device, readers: int
) -> tuple[torch.Tensor, list[bytes], str]:
    """Allocate a piece on ``device``; returns it, one serialised IPC handle per reader index and
    the GPU's UUID."""
    from torch.multiprocessing.reductions import reduce_tensor

    piece = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device)
    _LOCAL_PIECES[seg_name] = piece
    blobs = []
    for _ in range(readers):
        _, args = reduce_tensor(piece)  # a fresh reference counter per reader
        blobs.append(encode_cuda_handle(os.getpid(), args))
    torch.cuda.synchronize(device)  # the zeros are written before anyone maps the piece
    return piece, blobs, device_uuid(device)


def cuda_piece_open(seg_name: str, blob: bytes, uuid: str, map_on: torch.device | None = None) -> torch.Tensor:
    """Map a piece created by ``cuda_piece_create`` (in this or another process of the node).

    ``map_on``: the reader's own GPU. The handle is then opened in that GPU's context (CUDA maps
    the other GPU's memory there with peer access, ``cudaIpcMemLazyEnablePeerAccess``), so torch
    sees the piece on the reader's device and a pull is a same-device copy issued on the reader's
    current stream, run by the reader's GPU; without it (or where peer access is refused) the piece
    is mapped on the owner's GPU and torch runs each copy on the owner's stream, beside training."""
    local = _LOCAL_PIECES.get(seg_name)
    if local is not None:
        return local
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    pid, args = decode_cuda_handle(blob)
    if pid == os.getpid():
        raise ServerError(f"piece {seg_name} was created by this process but is no longer alive here")
    args = list(args)
    owner = local_device_of(uuid)
    if map_on is not None and map_on.type == "cuda" and map_on != owner:
        args[_STORAGE_DEVICE] = map_on.index if map_on.index is not None else torch.cuda.current_device()
        try:
            return rebuild_cuda_tensor(*args)
        except RuntimeError:  # no peer access between the two GPUs: map it on its owner
            pass
    args[_STORAGE_DEVICE] = owner.index
    return rebuild_cuda_tensor(*args)


def cuda_piece_release(seg_name: str) -> None:
    """The owner drops its piece (torch keeps the block out of reuse while a reader still maps it)."""
    _LOCAL_PIECES.pop(seg_name, None)


def sync_device(device: torch.device) -> None:
    """Wait for queued copies on ``device`` (a stamp check is only meaningful after them)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def broadcast_pull(
    group, src_rank: int, tensors: dict[str, torch.Tensor], bucket_bytes: int = 64 << 20
) -> dict[str, torch.Tensor]:
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
            flat = (
                torch.cat([t.reshape(-1) for t in bucket])
                if is_src
                else torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            )
            dist.broadcast(flat, src=src_rank, group=group)
            if not is_src:
                pos = 0
                for t in bucket:
                    t.copy_(flat[pos : pos + t.numel()].view(t.shape))
                    pos += t.numel()
        bucket.clear()

    size = 0
    for name in names:
        t = tensors[name]
        if bucket and (
            t.dtype != bucket[0].dtype
            or t.device != bucket[0].device
            or size + t.numel() * t.element_size() > bucket_bytes
        ):
            flush()
            size = 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    flush()
    return tensors
