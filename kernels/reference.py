"""fp64 reference for packed log-prob / entropy (tests only: materialises the [T, V] logits).

    from staleflow.kernels.reference import packed_logprobs_reference
    logp, entropy = packed_logprobs_reference(hidden, weight, targets, temperature, row_mask)

Same signature and meaning as ``staleflow.kernels.logprob.packed_logprobs_triton`` but computed in
float64 and returned as float64 (differentiable; gradients flow back to the caller's dtype).
Unselected rows (row_mask False) give exactly 0 and a zero gradient; their targets are ignored.
"""

import torch


def packed_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                              temperature: float = 1.0, row_mask: torch.Tensor | None = None):
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
