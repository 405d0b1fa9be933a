"""PagedAttention: the attention object the engine hands to the model for one step.

The model calls `attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]` once
per layer (RoPE already applied). T packs, in order, the single tokens of the decoding
sequences (in a speculative step each followed by its draft tokens: a short causal query block
per sequence over its cache, speculative.py) and then the prefill chunks. For every layer this object
1. writes the step's k/v into the paged cache at `slot_mapping` ([T] flat slot ids);
2. decodes, by the backend ModelRunner resolved once (`decode_backend.py`):
   - "triton" / "flash" (CUDA): one kernel reads each sequence's K/V in place through its block
     table (`block_tables`, `context_lens`), no copy;
   - "mirror" (CPU default): the decoding sequences' K/V are dense DecodeMirror rows; the new
     token is written to its row too and SDPA reads a view;
   - "gather": each decoding sequence's K/V is gathered into a padded [B, Lmax] batch (padding
     points at an all-zero null slot) for ONE SDPA with a key-length mask.
   In the SDPA paths GQA is free: the G query heads that share a kv head are laid out as G
   "query positions" of that head, so K/V are never repeated: q [B, Hkv, G, D] x k [B, Hkv, L, D];
3. prefill chunks: one causal SDPA per chunk over its cached context + the chunk itself, GQA
   without repeating K/V either (`prefill_sdpa`).
Index tensors are built once per step by ModelRunner (`StepContext`) and reused by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from staleflow.rollout.decode_backend import paged_decode


@dataclass(slots=True)
class PrefillChunk:
    start: int
    """First token of the chunk in the packed step."""
    end: int
    context_slots: torch.Tensor | None
    """[L] slots of all tokens 0..L-1 of the sequence (cached + this chunk); None = no cache hit."""
    mask: torch.Tensor | None
    """[n, L] bool causal mask with the cached offset; None means plain is_causal."""


@dataclass(slots=True)
class StepContext:
    slot_mapping: torch.Tensor
    """[T] int64: cache slot of every fed token."""
    num_decode: int = 0
    decode_tokens: int = 0
    """Td: the decoding sequences' fed tokens, first in the step (num_decode, plus the drafts of a
    speculative step: sequence b feeds its last token and its draft, W_b tokens in all)."""
    decode_width: int = 1
    """W = max W_b; > 1 only in a speculative step (then the three fields below are set)."""
    decode_q_index: torch.Tensor | None = None
    """[B * W] int64: the packed row of query (b, w), w past W_b repeating b's last row (discarded)."""
    decode_out_index: torch.Tensor | None = None
    """[Td] int64: where each fed decode token's output sits among the B * W queries."""
    mirror_rows: torch.Tensor | None = None
    """[Td] int64: the DecodeMirror row of each fed decode token (a speculative step's mirror path)."""
    decode_slots: torch.Tensor | None = None
    """[B * Lmax] int64: padded slots of the decoding sequences' contexts."""
    decode_mask: torch.Tensor | None = None
    """[B, 1, 1, Lmax] bool: True on real keys; None when every context has length Lmax. In a
    speculative step [B, 1, W * G, Lmax]: query (w, g) of sequence b sees keys up to its position."""
    decode_len: int = 0
    block_tables: torch.Tensor | None = None
    """[Td, max_blocks] int32 block tables of the fed decode tokens (triton / flash backends; a
    speculative step repeats a sequence's table for each of its tokens)."""
    context_lens: torch.Tensor | None = None
    """[Td] int32 context lengths of the fed decode tokens, the token itself included (triton / flash)."""
    mirror_pos: torch.Tensor | None = None
    """[Td] int64: position of each fed decode token in its DecodeMirror row (row i = decode i
    without drafts, else `mirror_rows`); None when decodes gather from the paged cache instead."""
    prefills: list[PrefillChunk] = field(default_factory=list)

    def __post_init__(self):
        if not self.decode_tokens:  # no drafts: one token per decoding sequence
            self.decode_tokens = self.num_decode


class PagedAttention:
    """Per-layer K/V cache [num_slots + block, Hkv, D] plus the step's context."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        # torch.empty: on CPU untouched pages stay unallocated; the scheduler reuses low blocks
        # first, so resident memory follows actual use. The null slot (index num_slots) is
        # zeroed because padded decode gathers read it (masked, but 0 * NaN would be NaN).
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k_cache = torch.empty(shape, dtype=dtype, device=device)
        self.v_cache = torch.empty(shape, dtype=dtype, device=device)
        self.k_cache[:, num_slots].zero_()
        self.v_cache[:, num_slots].zero_()
        self.null_slot = num_slots
        self.ctx: StepContext | None = None
        self.mirror = None
        """A DecodeMirror (set by ModelRunner) when decodes read dense rows instead of gathering."""
        self.backend = "gather"
        """The decode backend (set by ModelRunner from resolve_decode_backend)."""
        self.block_size = 1

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        kc, vc = self.k_cache[layer_idx], self.v_cache[layer_idx]  # [S, Hkv, D]
        kc.index_copy_(0, ctx.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, ctx.slot_mapping, v.to(vc.dtype))
        n_tok, n_heads, head_dim = q.shape
        n_kv = k.shape[1]
        group = n_heads // n_kv
        out = torch.empty_like(q)
        nd, td = ctx.num_decode, ctx.decode_tokens
        if nd and ctx.block_tables is not None:  # a kernel reads the paged cache in place, one row per token
            out[:td] = paged_decode(
                self.backend, q[:td], kc, vc, ctx.block_tables, ctx.context_lens, self.block_size, ctx.decode_len
            )
        elif nd:
            if ctx.mirror_pos is not None:  # dense rows: write the fed tokens, attend a view
                km, vm = self.mirror.k[layer_idx], self.mirror.v[layer_idx]  # [R, Hkv, Lcap, D]
                rows = ctx.mirror_rows if ctx.mirror_rows is not None else torch.arange(nd, device=q.device)
                km[rows, :, ctx.mirror_pos] = k[:td].to(km.dtype)
                vm[rows, :, ctx.mirror_pos] = v[:td].to(vm.dtype)
                kd, vd = km[:nd, :, : ctx.decode_len], vm[:nd, :, : ctx.decode_len]  # [B, Hkv, L, D]
            else:
                kd = kc.index_select(0, ctx.decode_slots).view(nd, ctx.decode_len, n_kv, head_dim).transpose(1, 2)
                vd = vc.index_select(0, ctx.decode_slots).view(nd, ctx.decode_len, n_kv, head_dim).transpose(1, 2)
            w = ctx.decode_width
            if w == 1:
                qd = q[:nd].view(nd, n_kv, group, head_dim)  # [B, Hkv, G, D]
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=ctx.decode_mask)  # [B, Hkv, G, D]
                out[:nd] = od.reshape(nd, n_heads, head_dim)
            else:  # speculative: the W tokens of a sequence are W * G query rows of each kv head
                qd = q[ctx.decode_q_index].view(nd, w, n_kv, group, head_dim).transpose(1, 2)  # [B, Hkv, W, G, D]
                qd = qd.reshape(nd, n_kv, w * group, head_dim)
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=ctx.decode_mask)  # [B, Hkv, W * G, D]
                od = od.view(nd, n_kv, w, group, head_dim).transpose(1, 2).reshape(nd * w, n_heads, head_dim)
                out[:td] = od[ctx.decode_out_index]
        for ch in ctx.prefills:
            qp = q[ch.start : ch.end].transpose(0, 1)  # [Hq, n, D]
            if ch.context_slots is None:
                kp, vp = k[ch.start : ch.end], v[ch.start : ch.end]  # [n, Hkv, D]
            else:
                kp, vp = kc.index_select(0, ch.context_slots), vc.index_select(0, ch.context_slots)  # [L, Hkv, D]
            kp, vp = kp.to(q.dtype).transpose(0, 1), vp.to(q.dtype).transpose(0, 1)  # [Hkv, L, D]
            op = prefill_sdpa(qp, kp, vp, ch.mask, stack_groups=ch.mask is not None and q.is_cuda)  # [Hq, n, D]
            out[ch.start : ch.end] = op.transpose(0, 1)
        return out


def prefill_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, stack_groups: bool = False
) -> torch.Tensor:
    """Causal attention of one prefill chunk, q [Hq, n, D] over k, v [Hkv, L, D] -> [Hq, n, D];
    mask [n, L] (the chunk after L - n cached tokens) or None (plain causal, L = n).

    GQA without repeating K/V: `enable_gqa` (bit-identical on CPU to repeating K/V, checked over
    360 shapes in fp32 and bf16; on CUDA the flash kernel takes it natively). With a mask on CUDA
    the kernel that accepts masks (memory-efficient) has no GQA and SDPA would fall back to the
    math path, so `stack_groups` puts the G query heads of each kv head in the batch dimension
    instead: q [G, Hkv, n, D] over K/V expanded to [G, Hkv, L, D] (stride 0: no copy) with the one
    [n, L] mask broadcast to every head (no copy per head either). 4-D inputs so CUDA picks a fused
    kernel.
    """
    n_heads, n, head_dim = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    if stack_groups and group > 1:
        qg = q.view(n_kv, group, n, head_dim).transpose(0, 1)  # [G, Hkv, n, D]: head h = kv * G + g
        kg, vg = k[None].expand(group, -1, -1, -1), v[None].expand(group, -1, -1, -1)  # [G, Hkv, L, D]
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask[None, None])  # [G, Hkv, n, D]
        return out.transpose(0, 1).reshape(n_heads, n, head_dim)
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, enable_gqa=group > 1
    )[0]
