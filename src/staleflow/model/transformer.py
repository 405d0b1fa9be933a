"""CausalLM: our Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder over packed variable-length token streams.

Parameter names equal Hugging Face's (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight` when
untied), so `state_dict()` maps 1:1 onto HF safetensors. The forward takes one packed stream
and a pluggable attention object, and returns the final hidden states (after the last RMSNorm,
before the LM head) because the packed log-prob op consumes those:

    hidden = model(input_ids, positions, attn)   # [T], [T], attn(layer, q, k, v) -> [T, H, D]
    logits = model.compute_logits(hidden)        # [T, V] float32, only when really needed

The attention object owns the sequence layout (packed causal for training/prefill, a KV cache
for decoding) and the GQA expansion; the model only computes q, k, v with RoPE applied.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from staleflow.model.args import ModelArgs
from staleflow.model.moe import SparseMoeBlock


class Attention(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in float32 then cast back (as HF does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is one fused op and bit-identical to x * rsqrt(mean(x^2) + eps) in
        # fp32/bf16/fp64 (checked); the weight is applied after the cast back, as HF does
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


def rope_inv_freq(args: ModelArgs, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32, CPU) and the cos/sin scale for args' RoPE type.

    default: theta^(-2i/d). linear: divided by factor. dynamic (NTK): base grows with
    seq_len beyond max_position_embeddings. llama3: low frequencies divided by factor, high
    kept, a smooth ramp between. yarn: per-dimension blend of interpolated and extrapolated
    frequencies, cos/sin scaled by 0.1*ln(factor)+1.
    """
    dim = args.head_dim
    base = args.rope_theta
    sc = args.rope_scaling or {}
    rope_type = args.rope_type
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [d/2]
    if rope_type == "dynamic":
        factor = sc["factor"]
        seq_len = max(seq_len or 0, args.max_position_embeddings)
        base = base * ((factor * seq_len / args.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)
    scale = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / sc["factor"]
    elif rope_type == "llama3":
        factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_len = sc.get("original_max_position_embeddings", args.max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        inv_freq, scale = _yarn(args, sc)
    return inv_freq, scale


def _yarn(args: ModelArgs, sc: dict) -> tuple[torch.Tensor, float]:
    dim, base = args.head_dim, args.rope_theta
    old_len = sc.get("original_max_position_embeddings", args.max_position_embeddings)
    factor = sc.get("factor") or args.max_position_embeddings / old_len

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    scale = sc.get("attention_factor")
    if scale is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        scale = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # weight on the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(scale)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated: x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1).

    Written as x * cos + (x2, x1) * (-sin1, sin2) (`sin_signed`, [T, 1, D]): a flip of the two
    halves instead of chunk + neg + cat, bit-identical (negation is exact) and two ops fewer.
    """
    T, H, D = x.shape
    return x * cos + x.view(T, H, 2, D // 2).flip(2).view(T, H, D) * sin_signed


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, d
        o_bias = args.attention_bias and args.architecture != "qwen2"
        self.q_proj = nn.Linear(h, args.num_heads * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.num_heads * d, h, bias=o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.qkv_w: torch.Tensor | None = None
        """[(H + 2 Hkv) D, hidden] q|k|v weights, one contiguous matrix (set by CausalLM.fuse_projections)."""
        self.qkv_b: torch.Tensor | None = None

    def forward(self, x, cos, sin, attn: Attention, layer_idx: int):
        """x [T, hidden]; cos, sin: [T, 1, D] from CausalLM.rope_cos_sin (sin in signed form)."""
        T = x.shape[0]
        if self.qkv_w is not None:  # inference layout (CausalLM.fuse_projections): one GEMM
            qkv = F.linear(x, self.qkv_w, self.qkv_b)
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = qkv.split((nq, nkv, nkv), dim=-1)
            q = q.view(T, self.n_heads, self.head_dim)
            k = k.view(T, self.n_kv_heads, self.head_dim)
            v = v.view(T, self.n_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(T, self.n_heads, self.head_dim)  # [T, H, D]
            k = self.k_proj(x).view(T, self.n_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qkv_w is not None and not hasattr(self, "q_norm"):  # q|k adjacent: rotate both at once
            qk = apply_rope(qkv[:, : nq + nkv].view(T, self.n_heads + self.n_kv_heads, self.head_dim), cos, sin)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(layer_idx, q, k, v).reshape(T, self.n_heads * self.head_dim)  # [T, H * D]
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); ``intermediate`` defaults to the dense layers' width
    (an expert of a MoE layer passes its own width and its lighter ``linear``: model/moe.py)."""

    def __init__(self, args: ModelArgs, intermediate: int | None = None, linear=nn.Linear):
        super().__init__()
        inter = intermediate or args.intermediate_size
        self.gate_proj = linear(args.hidden_size, inter, bias=False)
        self.up_proj = linear(args.hidden_size, inter, bias=False)
        self.down_proj = linear(inter, args.hidden_size, bias=False)
        self.gate_up_w: torch.Tensor | None = None
        """[2 I, hidden] gate|up weights, one contiguous matrix (set by CausalLM.fuse_projections)."""

    def forward(self, x):
        if self.gate_up_w is not None:
            gate, up = F.linear(x, self.gate_up_w).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = SelfAttention(args)
        self.sparse = args.is_moe_layer(layer_idx)
        self.mlp = SparseMoeBlock(args, MLP) if self.sparse else MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, attn: Attention):
        """x [T, hidden] -> x [T, hidden]; a sparse (MoE) layer returns (x, router stats [2, E])."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, self.layer_idx)
        if self.sparse:
            y, stats = self.mlp(self.post_attention_layernorm(x))
            return x + y, stats
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """The `model.` prefix of HF names: embed_tokens, layers, norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 / Qwen3-MoE causal LM with HF parameter names and a packed forward."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderStack(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.gradient_checkpointing = False
        """Recompute each decoder layer in backward (set by the trainer to save activations)."""
        self._rope_cache: dict[tuple[torch.device, int], tuple[torch.Tensor, float]] = {}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] output projection (the embedding matrix when tied)."""
        return self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed [T, 1, head_dim] for integer positions (float32 math, cast to dtype).

        sin_signed is (-sin, sin) over the two halves of head_dim: the form `apply_rope` takes.
        """
        seq_len = int(positions.max()) + 1 if self.args.rope_type == "dynamic" and positions.numel() else 0
        key = (positions.device, max(seq_len, self.args.max_position_embeddings) if seq_len else 0)
        cached = self._rope_cache.get(key)
        if cached is None:
            inv_freq, scale = rope_inv_freq(self.args, seq_len or None)
            cached = self._rope_cache[key] = (inv_freq.to(positions.device), scale)
        inv_freq, scale = cached
        with torch.autocast(device_type=positions.device.type, enabled=False):
            freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
            cos, sin = emb.cos() * scale, emb.sin() * scale
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention, router_stats: bool = False):
        """input_ids, positions: [T] -> final hidden states [T, hidden] (after the last RMSNorm).

        ``router_stats``: return (hidden, stats) where stats [L, 2, E] stacks every sparse layer's
        routing statistics (model/moe.py; None for a dense model)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be 1-D [T] (packed), got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        stats = []
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, attn, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn)
            if isinstance(x, tuple):  # a sparse layer: (x, its router stats)
                x, s = x
                stats.append(s)
        hidden = self.model.norm(x)
        if router_stats:
            return hidden, (torch.stack(stats) if stats else None)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] hidden -> [T, V] float32 logits (float64 for a float64 model, used by references).

        A bf16 / fp16 model's hidden states and LM head are upcast before the product, as the
        trainer's log-prob path does: logits rounded to bf16 would differ from the trainer's by up
        to half a bf16 ulp of the logit (0.06 at |logit| 16), a systematic behaviour/trainer gap.
        """
        w = self.lm_head_weight
        if w.dtype == torch.float64:
            return F.linear(hidden, w)
        return F.linear(hidden.float(), w.float())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (HF name, tensor) pairs into the existing parameters in place; returns the count.

        In place (dtype and device converted) so references held elsewhere (optimizers, CUDA
        graphs, a rollout engine) stay valid; `lm_head.weight` is skipped when tied. An unknown
        name or a wrong shape raises ValueError naming the tensor.
        """
        params = dict(self.named_parameters())
        n = 0
        for name, t in weights:
            if name.endswith("rotary_emb.inv_freq") or (self.args.tie_word_embeddings and name == "lm_head.weight"):
                continue
            p = params.get(name)
            if p is None:
                raise ValueError(f"load_weights: {name!r} is not a parameter of this {self.args.architecture} model")
            if p.shape != t.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            p.copy_(t)
            n += 1
        return n

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> CausalLM:
        """Random init (normal(0, std) matrices, unit norms, zero biases); deterministic given seed."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        return self

    @torch.no_grad()
    def fuse_projections(self) -> CausalLM:
        """Switch to the inference weight layout; for rollout engines, never for training.

        q|k|v and gate|up become one [out, in] matrix each (HF's orientation): ``F.linear(x, W)``
        is one GEMM instead of three (two). The Linear parameters are re-pointed to row blocks of
        those matrices, so names, shapes and values are unchanged, every parameter stays
        contiguous (a row block of a contiguous matrix), and in-place loads (`load_weights`,
        `copy_`, a Parameter Server pull) update the fused matrices with plain contiguous
        copies; q|k|v (gate|up) are adjacent in memory in that order, the order of the Parameter
        Server layout's fused groups (servers/layout.py), so a pull copies each fused matrix at
        once. Idempotent. The views share one storage per fused matrix, which FSDP and
        optimizers that replace parameters do not expect: hence inference only.
        """
        for layer in self.model.layers:
            a = layer.self_attn
            if a.qkv_w is not None:
                continue
            a.qkv_w, a.qkv_b = _fuse_linears(a.q_proj, a.k_proj, a.v_proj)
            for m in layer.mlp.experts if layer.sparse else (layer.mlp,):  # every expert is a SwiGLU MLP
                m.gate_up_w, _ = _fuse_linears(m.gate_proj, m.up_proj)
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def num_active_params(self) -> int:
        """Parameters one token runs through: all, less the experts it is not routed to (a MoE
        layer runs k of its E experts); embeddings and the LM head count once each."""
        a = self.args
        idle = 0
        for layer in self.model.layers:
            if layer.sparse:
                per_expert = sum(p.numel() for p in layer.mlp.experts[0].parameters())
                idle += (a.num_experts - a.num_experts_per_tok) * per_expert
        return self.num_params() - idle


def _fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the Linears' weights along out into one contiguous [sum(out), in] matrix and
    re-point each weight (and bias) to its row block of it. Returns (weight, bias or None)."""
    w = torch.cat([lin.weight.detach() for lin in linears], 0).contiguous()
    has_bias = [lin.bias is not None for lin in linears]
    bias = torch.cat([lin.bias.detach() for lin in linears]).contiguous() if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("fuse_projections: some of the fused projections have a bias and some do not")
    off = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(w[off : off + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[off : off + n], requires_grad=False)
        off += n
    return w, bias
