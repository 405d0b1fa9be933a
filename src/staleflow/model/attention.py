"""Packed variable-length causal attention for training and prefill.

A packed batch is B sequences laid end to end in one [T] token stream, described by
`cu_seqlens` = [0, len_0, len_0 + len_1, ..., T] (int32). Each token attends causally to the
tokens of its own sequence only. Usage with `CausalLM`:

    cu = cu_seqlens_from_lengths([5, 3, 7])
    hidden = model(ids, packed_positions(cu), PackedAttention(cu))

Backends:
- "flash": flash-attn's `flash_attn_varlen_func` (CUDA only; imported lazily);
- "sdpa": `torch.nn.functional.scaled_dot_product_attention` with a block-diagonal causal
  boolean mask (exact and differentiable on CPU). Sequences are grouped into chunks of at most
  `sdpa_chunk_tokens` tokens (default 4096 on CPU) so the mask stays small; a sequence alone
  in its chunk runs with `is_causal=True` and no mask. On CUDA the default chunk is 0: every
  sequence runs alone, so SDPA can pick its flash kernel and no [n, n] mask is built.
- "auto": flash when flash-attn is importable, the tensors are on CUDA and in fp16/bf16,
  else sdpa.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "flash", "sdpa")


def cu_seqlens_from_lengths(lengths: Sequence[int] | torch.Tensor, device=None) -> torch.Tensor:
    """[B] sequence lengths -> int32 [B+1] cumulative offsets starting at 0."""
    lens = torch.as_tensor(lengths, dtype=torch.int64, device=device).flatten()
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"sequence lengths must be >= 0, got {lens.tolist()}")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    return cu


def packed_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [T] position of every token inside its own sequence (0, 1, ..., len-1 per sequence)."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]  # [B]
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], lens, output_size=total)  # [T]
    return torch.arange(total, device=cu.device) - starts


def _flash_available() -> bool:
    """flash-attn is installed and not switched off (STALEFLOW_NO_FLASH_ATTN=1: SDPA instead; the
    start-up check, launch/environment.py, runs it once and names this switch when it fails)."""
    return importlib.util.find_spec("flash_attn") is not None and os.environ.get("STALEFLOW_NO_FLASH_ATTN") != "1"


class PackedAttention:
    """Attention over a packed batch; called by each decoder layer as attn(layer_idx, q, k, v).

    q: [T, n_heads, head_dim], k and v: [T, n_kv_heads, head_dim] (RoPE already applied);
    returns [T, n_heads, head_dim]. GQA: each kv head serves n_heads // n_kv_heads query heads.
    """

    def __init__(self, cu_seqlens: torch.Tensor, backend: str = "auto", sdpa_chunk_tokens: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"attention backend={backend!r} is unknown: use one of {list(BACKENDS)}")
        cu = torch.as_tensor(cu_seqlens)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be a 1-D non-decreasing tensor starting at 0, got {cu.tolist()[:8]}")
        self.cu_seqlens = cu.to(torch.int32)
        self.backend = backend
        self.sdpa_chunk_tokens = sdpa_chunk_tokens
        self._offsets = [int(x) for x in cu.tolist()]  # one host sync, at construction
        self.num_tokens = self._offsets[-1]
        self.max_seqlen = max(b - a for a, b in zip(self._offsets[:-1], self._offsets[1:]))
        self._chunks: dict[int, list[tuple[int, int, list[int]]]] = {}
        self._masks: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self._cu_device: dict[torch.device, torch.Tensor] = {}

    def resolve_backend(self, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
        if self.backend == "auto":
            half = dtype in (torch.float16, torch.bfloat16)
            return "flash" if device.type == "cuda" and half and _flash_available() else "sdpa"
        if self.backend == "flash":
            if device.type != "cuda":
                raise ValueError(f"attention backend='flash' needs CUDA tensors, got device {device}: use 'sdpa'")
            if not _flash_available():
                raise ValueError("attention backend='flash' needs flash-attn: pip install flash-attn, or use 'sdpa'")
        return self.backend

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens but cu_seqlens describes {self.num_tokens}")
        if self.resolve_backend(q.device, q.dtype) == "flash":
            return self._flash(q, k, v)
        return self._sdpa(q, k, v)

    def _flash(self, q, k, v):
        from flash_attn import flash_attn_varlen_func

        cu = self._cu_device.get(q.device)
        if cu is None:
            cu = self._cu_device[q.device] = self.cu_seqlens.to(q.device)
        return flash_attn_varlen_func(q, k, v, cu, cu, self.max_seqlen, self.max_seqlen, causal=True)  # [T, H, D]

    def _chunk_plan(self, cap: int) -> list[tuple[int, int, list[int]]]:
        """Group consecutive sequences into chunks of <= cap tokens (a longer sequence alone):
        (token start, token end, sequence offsets inside the chunk)."""
        if cap not in self._chunks:
            offs = self._offsets
            groups: list[tuple[int, int]] = []  # [first sequence, last sequence + 1)
            first = 0
            for i in range(len(offs) - 1):
                if offs[i + 1] - offs[first] > cap and i > first:
                    groups.append((first, i))
                    first = i
            groups.append((first, len(offs) - 1))
            self._chunks[cap] = [
                (offs[s], offs[e], [o - offs[s] for o in offs[s : e + 1]]) for s, e in groups if offs[e] > offs[s]
            ]
        return self._chunks[cap]

    def _mask(self, start: int, bounds: list[int], device: torch.device) -> torch.Tensor:
        """Block-diagonal causal mask [n, n] of the chunk starting at token `start` (cached)."""
        key = (start, bounds[-1], device)
        mask = self._masks.get(key)
        if mask is None:
            n = bounds[-1]
            lens = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
            seq_id = torch.repeat_interleave(torch.arange(len(lens), device=device), lens, output_size=n)  # [n]
            idx = torch.arange(n, device=device)
            mask = (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])  # [n, n]
            self._masks[key] = mask
        return mask

    def _sdpa(self, q, k, v):
        n_heads, n_kv = q.shape[1], k.shape[1]
        if n_heads != n_kv:
            k = k.repeat_interleave(n_heads // n_kv, dim=1)  # [T, H, D]
            v = v.repeat_interleave(n_heads // n_kv, dim=1)
        cap = self.sdpa_chunk_tokens
        if cap is None:
            cap = 0 if q.device.type == "cuda" else 4096
        outs = []
        for a, b, bounds in self._chunk_plan(cap):
            qc, kc, vc = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
            if len(bounds) == 2:
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=self._mask(a, bounds, q.device))
            outs.append(o[0].transpose(0, 1))  # [n, H, D]
        if not outs:
            return q.new_zeros(q.shape)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
