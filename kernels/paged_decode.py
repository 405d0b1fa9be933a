"""Paged decode attention: one query token per sequence, K/V read in place through the block table.

    from staleflow.kernels.paged_decode import paged_decode_attention
    out = paged_decode_attention(q[B, Hq, D], k_cache[S, Hkv, D], v_cache[S, Hkv, D],
                                 block_tables[B, max_blocks] int32, context_lens[B] int32,
                                 block_size, max_context_len=None, scale=None)   # -> [B, Hq, D]

Sequence b's token i lives in cache slot ``block_tables[b, i // block_size] * block_size +
i % block_size`` (the engine's paged layout: a per-layer ``[slots, Hkv, D]`` tensor, which is also
``[num_blocks, block_size, Hkv, D]`` viewed block-major). The query attends to its sequence's
first ``context_lens[b]`` tokens (its own new token included: the caller writes it first).
Why a kernel: gathering every sequence's K/V into a padded batch before SDPA copies all the KV
bytes per layer per step (at batch 64 x 8k context on Qwen2.5-7B: ~1 GB per layer, read, written
and read again); this reads them once, where they lie.

Algorithm (flash-decoding with a fixed partition, `_decode_kernel`, grid B x Hkv x P):
1. program (b, kv head, p) loads the G = Hq / Hkv query heads that share the kv head as the rows
   of a [G_PAD, D] tile (GQA without expanding K/V: each K/V tile is loaded once per group);
2. it walks its partition, tokens [p * PARTITION, (p + 1) * PARTITION) cut at the context
   length, in BLOCK_N tiles: slots from the block table, s = q k^T * scale * log2(e) (base-2
   logits, fp32 accumulation), online softmax (running max m starts at NEG = -1e30, finite, so
   masked lanes never form (-inf) - (-inf); l = sum 2^(s - m); acc = sum 2^(s - m) v);
3. one partition in the whole batch (max context <= PARTITION): it writes acc / l directly.
   Otherwise it writes (m, l, acc) and `_merge_kernel` (grid B x Hq) combines the sequence's
   cdiv(len, PARTITION) partitions with the same rescaling rule, in partition order.
The partition size is fixed (never derived from the batch), so a sequence's output does not
depend on what else is in the batch; a single-partition merge reproduces the direct write
bit for bit (its weights are exp2(0) = 1 and exp2(NEG - m) = 0).

Numerics: fp32 accumulation and softmax for every input dtype. For bf16 / fp16 the
probabilities are rounded to the input dtype before the p @ v product (tensor cores), as
flash-attn does; fp32 inputs use exact fp32 dots (``input_precision="ieee"``, not TF32).
Written for triton >= 3.6; runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (set
before this module is imported).
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # triton missing or broken: available() says False
    triton = None
    _TRITON_IMPORT_ERROR = exc

_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_LOG2E = 1.4426950408889634
PARTITION = 512
"""Tokens per partition (split-K). Fixed, so results are batch invariant; vLLM's v2 uses 512."""


def available(device: torch.device | str | None = None) -> bool:
    """True when the kernel can run on `device`: CUDA with triton, or CPU under the interpreter."""
    if triton is None:
        return False
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return kind == "cuda" or (kind == "cpu" and _INTERPRETING)


if triton is not None:
    NEG = tl.constexpr(-1.0e30)

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        lens_ptr,
        out_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        stride_qb,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_tb,
        stride_ob,
        stride_oh,
        num_parts,
        scale2,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PART: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        ctx_len = tl.load(lens_ptr + b)
        start = part * PART
        if start < ctx_len:  # partitions past the context do nothing (the merge never reads them)
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D_PAD)
            g_ok = offs_g < GROUP
            d_ok = offs_d < HEAD_DIM
            heads = kvh * GROUP + offs_g  # [G_PAD] query heads of this kv head
            q = tl.load(
                q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [G_PAD, D_PAD]
            if UPCAST:
                q = q.to(tl.float32)
            m = tl.full([G_PAD], NEG, dtype=tl.float32)
            l = tl.zeros([G_PAD], dtype=tl.float32)
            acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
            end = tl.minimum(start + PART, ctx_len)
            table = table_ptr + b.to(tl.int64) * stride_tb
            for n0 in range(start, end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < end
                blk = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
                slot = blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE  # [BLOCK_N]
                kv_ok = n_ok[:, None] & d_ok[None, :]
                k = tl.load(
                    k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_ok, other=0.0
                )  # [BLOCK_N, D_PAD]
                v = tl.load(
                    v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_ok, other=0.0
                )
                if UPCAST:
                    k = k.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale2  # [G_PAD, BLOCK_N]
                s = tl.where(n_ok[None, :], s, NEG)  # the tile holds >= 1 real key: m_new is real
                m_new = tl.maximum(m, tl.max(s, 1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[:, None])
                l = l * alpha + tl.sum(p, 1)
                pv = p.to(v_ptr.dtype.element_ty)  # bf16/fp16: rounded as flash-attn does; fp32: as is
                if UPCAST:
                    pv = pv.to(tl.float32)
                    v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
                m = m_new
            row_ok = g_ok[:, None] & d_ok[None, :]
            if SPLIT:
                ml = (b * num_parts + part).to(tl.int64) * (GROUP * tl.num_programs(1)) + heads  # [G_PAD]
                tl.store(m_ptr + ml, m, mask=g_ok)
                tl.store(l_ptr + ml, l, mask=g_ok)
                tl.store(acc_ptr + ml[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok)
            else:
                o = acc / l[:, None]
                tl.store(
                    out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                    o.to(out_ptr.dtype.element_ty),
                    mask=row_ok,
                )

    @triton.jit
    def _merge_kernel(
        lens_ptr,
        out_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        stride_ob,
        stride_oh,
        num_parts,
        num_heads,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        PART: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        n_parts = tl.cdiv(tl.load(lens_ptr + b), PART)
        big_m = tl.full([1], NEG, dtype=tl.float32)
        big_l = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([D_PAD], dtype=tl.float32)
        for p in range(0, n_parts):
            idx = (b * num_parts + p).to(tl.int64) * num_heads + h
            m_p = tl.load(m_ptr + idx + tl.zeros([1], dtype=tl.int64))
            l_p = tl.load(l_ptr + idx + tl.zeros([1], dtype=tl.int64))
            acc_p = tl.load(acc_ptr + idx * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
            m_new = tl.maximum(big_m, m_p)
            a = tl.exp2(big_m - m_new)  # first partition: exp2(NEG - m) = 0
            w = tl.exp2(m_p - m_new)
            big_l = big_l * a + l_p * w
            acc = acc * a + acc_p * w
            big_m = m_new
        o = acc / big_l
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok
        )


def _check(q, k_cache, v_cache, block_tables, context_lens, block_size) -> None:
    if triton is None:
        raise RuntimeError(f"triton is not importable ({_TRITON_IMPORT_ERROR}): use the gather decode path")
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"need q [B, Hq, D] and k_cache = v_cache [slots, Hkv, D], got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if k_cache.shape[2] != D or Hq % Hkv:
        raise ValueError(f"head_dim {k_cache.shape[2]} vs {D}, or {Hq} query heads not a multiple of {Hkv} kv heads")
    if (
        q.dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or k_cache.dtype != q.dtype
        or v_cache.dtype != q.dtype
    ):
        raise ValueError(
            f"q/k/v dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype}: need one of float32, "
            "bfloat16, float16 for all three"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [{B}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (B,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32 [{B}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if q.device.type == "cpu" and not _INTERPRETING:
        raise RuntimeError("CPU tensors need TRITON_INTERPRET=1 set before importing staleflow.kernels.paged_decode")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("k_cache / v_cache need a contiguous last dimension")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_context_len: int | None = None,
    scale: float | None = None,
    partition: int = PARTITION,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence over its paged context; returns [B, Hq, D] in q's dtype.

    Every context_lens[b] must be >= 1. max_context_len (the largest context_lens, known on the
    host in the engine) sizes the grid; None reads it from the device (one sync). `partition`
    must be a multiple of `block_n` (tests use small ones to exercise the merge).
    """
    _check(q, k_cache, v_cache, block_tables, context_lens, block_size)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    out = torch.empty_like(q)
    if B == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if block_n is None:
        block_n = 64 if q.is_cuda else 16  # the interpreter pays per element, not per program
    if num_warps is None:  # sm_90 offline compile (tests): fp32 at 4 warps spills, at 8 it takes 64 registers
        num_warps = 8 if q.dtype == torch.float32 else 4
    if partition % block_n:
        raise ValueError(f"partition={partition} must be a multiple of block_n={block_n}")
    num_parts = max(1, triton.cdiv(max_context_len, partition))
    split = num_parts > 1
    d_pad = max(16, triton.next_power_of_2(D))
    g_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16
    scale2 = (1.0 / math.sqrt(D) if scale is None else float(scale)) * _LOG2E
    if split:
        m_ws = torch.empty((B, num_parts, Hq), device=q.device, dtype=torch.float32)
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty((B, num_parts, Hq, D), device=q.device, dtype=torch.float32)
    else:
        m_ws = l_ws = acc_ws = out  # unused when SPLIT is False
    upcast = _INTERPRETING and q.dtype == torch.bfloat16  # interpreter bug: bf16 tl.dot on raw bits
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    _decode_kernel[(B, Hkv, num_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        m_ws,
        l_ws,
        acc_ws,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_parts,
        scale2,
        GROUP=group,
        G_PAD=g_pad,
        HEAD_DIM=D,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PART=partition,
        SPLIT=split,
        DOT_PREC=prec,
        UPCAST=upcast,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _merge_kernel[(B, Hq)](
            context_lens,
            out,
            m_ws,
            l_ws,
            acc_ws,
            out.stride(0),
            out.stride(1),
            num_parts,
            Hq,
            HEAD_DIM=D,
            D_PAD=d_pad,
            PART=partition,
            num_warps=4,
        )
    return out
