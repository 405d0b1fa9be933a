"""Per-token log-probs and entropy of packed tokens from hidden states, without [T, V] logits.

    logp, entropy = packed_logprobs(hidden, lm_head_weight, targets, temperature=1.0)

For every row t: z = W h_t / temperature (fp32), logp_t = z[y_t] - lse(z), and
entropy_t = lse(z) - E_p[z] with p = softmax(z). Both outputs are fp32 [T] and differentiable
with respect to hidden and weight. Implementations (``impl``):

- "chunked" (CPU default): a custom autograd Function that walks the rows in chunks of
  `chunk_tokens`, so only a [chunk, V] block of logits ever exists. Forward saves only
  hidden, weight, targets and the per-row log-sum-exp; backward recomputes each chunk's logits.
  Gradient w.r.t. the logits (before the 1/temperature chain factor), per row:
      from logp:    g_logp * (onehot(y) - p)
      from entropy: -g_H * p * (z - E_p[z])      (the stable form; -p (log p + H) gives
                                                   0 * -inf = NaN when p underflows)
  then dh = dz @ W and dW = dz^T @ h, accumulated chunk by chunk.
- "naive": the straightforward full-logits reference (tests, benchmarks).
- "triton": the fused kernel in `staleflow.kernels.logprob` (CUDA; imported lazily).
- "auto": triton for CUDA tensors when the kernel is available, chunked otherwise.

Rows where `row_mask` is False give logp = entropy = 0 and no gradient (their target may be any
value, e.g. a padding id). Computation is in fp32, or fp64 when the inputs are fp64 (gradcheck).
"""

from __future__ import annotations

import warnings

import torch

IMPLS = ("auto", "chunked", "naive", "triton")
DEFAULT_CHUNK_ELEMENTS = 1 << 23
"""Logit elements per chunk (32 MiB in fp32): rows per chunk = this // vocab size."""


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk_rows(num_rows: int, vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens!r} is invalid: must be >= 1")
        return chunk_tokens
    return max(1, min(max(num_rows, 1), DEFAULT_CHUNK_ELEMENTS // max(vocab, 1)))


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, row_mask, temperature: float, chunk: int):
        cdt = _compute_dtype(hidden)
        T = hidden.shape[0]
        logp = torch.zeros(T, dtype=cdt, device=hidden.device)
        entropy = torch.zeros(T, dtype=cdt, device=hidden.device)
        lse = torch.zeros(T, dtype=cdt, device=hidden.device)
        w = weight.to(cdt)  # [V, H]
        safe_targets = torch.where(row_mask, targets, torch.zeros_like(targets))
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            z = hidden[a:b].to(cdt) @ w.t()  # [C, V]
            if temperature != 1.0:
                z.div_(temperature)
            m = z.amax(-1, keepdim=True)  # [C, 1]
            e = torch.exp(z - m)  # [C, V] exp(z - m), the only other [C, V] buffer
            s = e.sum(-1, keepdim=True)  # [C, 1]
            lse_c = (m + torch.log(s))[:, 0]  # [C]
            ez = (e.mul_(z).sum(-1, keepdim=True) / s)[:, 0]  # E_p[z], reusing e in place
            logp[a:b] = z.gather(1, safe_targets[a:b, None])[:, 0] - lse_c
            entropy[a:b] = lse_c - ez
            lse[a:b] = lse_c
            del z, e
        mask = row_mask.to(cdt)
        logp = logp * mask
        entropy = entropy * mask
        ctx.save_for_backward(hidden, weight, safe_targets, row_mask, lse)
        ctx.temperature = temperature
        ctx.chunk = chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, row_mask, lse = ctx.saved_tensors
        cdt = lse.dtype
        T = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(cdt)
        dh = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        mask = row_mask.to(cdt)
        g_logp = torch.zeros(T, dtype=cdt, device=hidden.device) if g_logp is None else g_logp.to(cdt) * mask
        g_ent = torch.zeros(T, dtype=cdt, device=hidden.device) if g_ent is None else g_ent.to(cdt) * mask
        for a in range(0, T, ctx.chunk):
            b = min(a + ctx.chunk, T)
            h = hidden[a:b].to(cdt)  # [C, H]
            z = h @ w.t()  # [C, V], recomputed
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            p = torch.exp(z - lse[a:b, None])  # [C, V]
            ez = (p * z).sum(-1, keepdim=True)  # [C, 1]
            # dz = -p * (g_logp + g_ent * (z - E_p[z])) + g_logp * onehot(y), built in z's buffer
            dz = z.sub_(ez).mul_(g_ent[a:b, None]).add_(g_logp[a:b, None]).mul_(p).neg_()
            del p
            dz.scatter_add_(1, targets[a:b, None], g_logp[a:b, None])
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if need_h:
                dh[a:b] = dz @ w
            if need_w:
                dw.addmm_(dz.t(), h)
            del dz, z
        return (
            dh.to(hidden.dtype) if need_h else None,
            dw.to(weight.dtype) if need_w else None,
            None,
            None,
            None,
            None,
        )


def naive_logprobs(hidden, weight, targets, temperature: float = 1.0, row_mask=None):
    """Reference: full [T, V] logits in fp32 (fp64 for fp64 inputs), plain autograd."""
    cdt = _compute_dtype(hidden)
    row_mask = _mask(row_mask, hidden)
    z = (hidden.to(cdt) @ weight.to(cdt).t()) / temperature  # [T, V]
    lse = torch.logsumexp(z, dim=-1)
    safe = torch.where(row_mask, targets, torch.zeros_like(targets))
    logp = z.gather(1, safe[:, None])[:, 0] - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    m = row_mask.to(cdt)
    return logp * m, entropy * m


def _mask(row_mask, hidden):
    if row_mask is None:
        return torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    return row_mask.to(device=hidden.device, dtype=torch.bool)


def _check(hidden, weight, targets, temperature, impl):
    if impl not in IMPLS:
        raise ValueError(f"logprob impl={impl!r} is unknown: use one of {list(IMPLS)} (--train.logprob-impl)")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [T, H] and [V, H]")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets {tuple(targets.shape)} must be [T] with T={hidden.shape[0]}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is invalid: must be > 0")


_warned_fallback = False


def _triton_fn(required: bool):
    """The Triton kernel function, or None when unavailable (an error if it was asked for)."""
    global _warned_fallback
    try:
        from staleflow.kernels.logprob import packed_logprobs_triton, triton_available
    except ImportError as e:
        if required:
            raise RuntimeError(f"logprob impl='triton' needs staleflow.kernels.logprob: {e}") from e
        if not _warned_fallback:
            warnings.warn(f"Triton log-prob kernel unavailable ({e}); using the chunked PyTorch path", stacklevel=2)
            _warned_fallback = True
        return None
    if not triton_available():
        if required:
            raise RuntimeError("logprob impl='triton' but Triton cannot run here: use impl='chunked'")
        return None
    return packed_logprobs_triton


def packed_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
    impl: str = "auto",
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [T], entropy [T]) in fp32 (fp64 for fp64 inputs) for hidden [T, H], weight [V, H], targets [T]."""
    _check(hidden, weight, targets, temperature, impl)
    if impl == "triton" or (impl == "auto" and hidden.is_cuda):
        fn = _triton_fn(required=impl == "triton")
        if fn is not None:
            return fn(hidden, weight, targets, temperature=temperature, row_mask=row_mask)
    if impl == "naive":
        return naive_logprobs(hidden, weight, targets, temperature, row_mask)
    mask = _mask(row_mask, hidden)
    chunk = _chunk_rows(hidden.shape[0], weight.shape[0], chunk_tokens)
    return _ChunkedLogprobs.apply(hidden, weight, targets.to(torch.int64), mask, float(temperature), chunk)
