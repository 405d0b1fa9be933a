"""fp64 references for the kernels (tests only): packed log-prob / entropy (materialises the [T, V]
logits) and paged decode attention (`paged_decode_reference`, below).

    from staleflow.kernels.reference import packed_logprobs_reference
    logp, entropy = packed_logprobs_reference(hidden, weight, targets, temperature, row_mask)

Same signature and meaning as ``staleflow.kernels.logprob.packed_logprobs_triton`` but computed in
float64 and returned as float64 (differentiable; gradients flow back to the caller's dtype).
Unselected rows (row_mask False) give exactly 0 and a zero gradient; their targets are ignored.
"""

import torch


def packed_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
):
    """(logp [T] fp64, entropy [T] fp64): logits = hidden @ weight.T / temperature, in fp64."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: need > 0")
    logits = (hidden.double() @ weight.double().t()) / temperature  # [T, V]
    if row_mask is None:
        row_mask = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    safe_targets = torch.where(row_mask, targets.long(), 0)
    # Unselected rows are zeroed *before* the softmax so they carry no gradient at all.
    logits = torch.where(row_mask[:, None], logits, 0.0)
    lse = torch.logsumexp(logits, dim=-1)  # [T]
    logp = logits.gather(1, safe_targets[:, None]).squeeze(1) - lse
    p = torch.softmax(logits, dim=-1)
    entropy = lse - (p * logits).sum(-1)
    zero = torch.zeros((), dtype=torch.float64, device=hidden.device)
    return torch.where(row_mask, logp, zero), torch.where(row_mask, entropy, zero)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """fp64 [B, Hq, D] decode attention over a paged cache (tests only; one sequence at a time).

    Same meaning as ``staleflow.kernels.paged_decode.paged_decode_attention``: sequence b's
    token i is slot ``block_tables[b, i // block_size] * block_size + i % block_size`` of the
    [slots, Hkv, D] caches; query head h uses kv head h // (Hq / Hkv).
    """
    B, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty(B, Hq, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(context_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b].long()[pos // block_size] * block_size + pos % block_size  # [n]
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        att = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale  # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", att.softmax(-1), v)
    return out
