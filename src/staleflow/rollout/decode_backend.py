"""Where decode attention reads its K/V from: the one place the engine picks a decode backend.

    backend = resolve_decode_backend("auto", device, dtype, block_size)   # ModelRunner, once

- "mirror": DecodeMirror dense rows (docs/engine.md); the CPU default: on CPU the per-step
  gather of the paged cache costs as much as the attention itself.
- "gather": gather each decoding sequence's K/V into a padded [B, Lmax] batch, one SDPA with a
  key-length mask (GQA without expanding K/V). The fallback on CUDA without triton.
- "flash": flash-attn's `flash_attn_with_kvcache` with a block table, reading the paged cache in
  place. Preferred on CUDA when flash-attn is importable, the dtype is fp16/bf16 and the block
  size is a multiple of 256 (flash-attn 2's documented paged-KV constraint: "page_block_size
  must be a multiple of 256"); with the default block size 16 the Triton kernel runs instead.
- "triton": staleflow.kernels.paged_decode, the same in-place read for any block size and dtype.
  The CUDA default when flash does not apply; on CPU only under TRITON_INTERPRET=1 (tests).
The per-layer cache `[slots + 1, Hkv, D]` needs no layout change for either kernel: its first
`num_blocks * block_size` slots viewed as `[num_blocks, block_size, Hkv, D]` are flash-attn's
paged layout, and the Triton kernel addresses slots through the same block table.
"""

from __future__ import annotations

import importlib.util

import torch

from staleflow.rollout.engine import EngineError

DECODE_BACKENDS = ("auto", "mirror", "gather", "triton", "flash")
FLASH_PAGE_MULTIPLE = 256


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def triton_available(device: torch.device) -> bool:
    """The Triton decode kernel can run here (imports the kernel module: call lazily)."""
    try:
        from staleflow.kernels import paged_decode
    except Exception:
        return False
    return paged_decode.available(device)


def resolve_decode_backend(requested: str, device: torch.device, dtype: torch.dtype, block_size: int) -> str:
    """The decode backend for `requested` ("auto" or a name above) on this device / dtype / block
    size; an explicit choice that cannot run here is an EngineError naming why."""
    if requested not in DECODE_BACKENDS:
        raise EngineError(f"decode_backend={requested!r} is unknown: use one of {list(DECODE_BACKENDS)}")
    device = torch.device(device)
    half = dtype in (torch.float16, torch.bfloat16)
    flash_ok = device.type == "cuda" and half and block_size % FLASH_PAGE_MULTIPLE == 0 and flash_available()
    if requested == "auto":
        if device.type != "cuda":
            return "mirror"
        if flash_ok:
            return "flash"
        return "triton" if triton_available(device) else "gather"
    if requested == "flash" and not flash_ok:
        raise EngineError(
            f"decode_backend='flash' needs CUDA, fp16/bf16, block_size a multiple of "
            f"{FLASH_PAGE_MULTIPLE} (got {block_size}) and flash-attn installed (got device "
            f"{device}, {dtype}, flash-attn {'present' if flash_available() else 'missing'}): "
            f"use 'triton' or 'auto'"
        )
    if requested == "triton" and not triton_available(device):
        raise EngineError(
            f"decode_backend='triton' needs triton with CUDA (or TRITON_INTERPRET=1 set before "
            f"staleflow.kernels is imported, for CPU tests); device is {device}: use 'auto'"
        )
    return requested


def paged_decode(
    backend: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_context_len: int,
) -> torch.Tensor:
    """Decode attention over the paged cache in place. q [B, Hq, D]; k_cache / v_cache: one
    layer's [slots (+ null slot), Hkv, D]; block_tables int32 [B, max_blocks]; context_lens int32
    [B] (the new token included, already written). Returns [B, Hq, D]."""
    if backend == "flash":
        from flash_attn import flash_attn_with_kvcache

        num_blocks = (k_cache.shape[0] - 1) // block_size  # drop the null slot: whole blocks only
        shape = (num_blocks, block_size) + tuple(k_cache.shape[1:])
        kc = k_cache[: num_blocks * block_size].view(shape)  # [num_blocks, block_size, Hkv, D]
        vc = v_cache[: num_blocks * block_size].view(shape)
        out = flash_attn_with_kvcache(q.unsqueeze(1), kc, vc, cache_seqlens=context_lens, block_table=block_tables)
        return out[:, 0]  # [B, 1, Hq, D] -> [B, Hq, D]
    from staleflow.kernels.paged_decode import paged_decode_attention

    return paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, block_size, max_context_len=max_context_len
    )
