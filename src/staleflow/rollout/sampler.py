"""Sampler: next tokens and their log-probs from a batch of logits, one SamplingParams per row.

Per row r with temperature t_r (greedy rows use t = 1 for their log-prob):
1. logprobs = log_softmax(logits / t) in fp32                       [N, V]
2. the returned log-prob of the chosen token is logprobs[r, token]: the temperature-scaled,
   UNtruncated distribution. That is what the trainer recomputes (log_softmax(logits / t) of
   the same tokens), so behaviour and trainer log-probs agree up to float rounding; top-p /
   top-k only restrict which tokens may be drawn (the usual RL convention, as in verl/vLLM's
   "raw" log-probs; the truncated log-prob would differ from the trainer's by the log of the
   kept mass).
3. greedy rows: argmax; other rows: top-k / top-p filter (sorted), then inverse-CDF sampling
   with one uniform u per row.
u is a counter-based hash of (request seed, output position): it does not depend on the
batch, the device or on how many steps ran before, so a seeded request samples the same
tokens alone, in any batch, and after an abort + resume.
"""

from __future__ import annotations

import torch

from staleflow.rollout.engine import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64 finaliser: a well-mixed 64-bit hash of z."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform float in [0, 1) determined by (seed, position) only."""
    return (_mix64(_mix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * (1.0 / (1 << 53))


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 positions: list[int]) -> tuple[list[int], list[float]]:
        """logits [N, V] (any float dtype) -> (tokens, log-probs) for the N rows."""
        n = logits.shape[0]
        device = logits.device
        logits = logits.float()
        temps = [1.0 if p.temperature == 0 else p.temperature for p in params]
        if all(t == 1.0 for t in temps):
            scaled = logits
        else:
            scaled = logits / torch.tensor(temps, device=device, dtype=torch.float32)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)  # [N, V]
        tokens = torch.empty(n, dtype=torch.long, device=device)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        plain = [i for i, p in enumerate(params) if not p.greedy and p.top_p >= 1.0 and p.top_k == 0]
        trunc = [i for i, p in enumerate(params) if not p.greedy and (p.top_p < 1.0 or p.top_k > 0)]
        if len(greedy) == n:
            tokens = logits.argmax(dim=-1)
        elif greedy:
            idx = torch.tensor(greedy, device=device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        if plain:
            idx = torch.tensor(plain, device=device)
            u = torch.tensor([uniform(seeds[i], positions[i]) for i in plain], device=device, dtype=torch.float64)
            cdf = torch.cumsum(logprobs[idx].exp().double(), dim=-1)  # [n, V]
            tokens[idx] = _draw(cdf, u)
        if trunc:
            idx = torch.tensor(trunc, device=device)
            probs, order = torch.sort(logprobs[idx].exp(), dim=-1, descending=True)  # [n, V]
            vocab = probs.shape[-1]
            keep = torch.ones_like(probs, dtype=torch.bool)
            top_k = torch.tensor([params[i].top_k or vocab for i in trunc], device=device)
            keep &= torch.arange(vocab, device=device)[None, :] < top_k[:, None]
            top_p = torch.tensor([params[i].top_p for i in trunc], device=device, dtype=torch.float64)
            mass_before = torch.cumsum(probs.double(), dim=-1) - probs.double()
            keep &= mass_before < top_p[:, None]  # always keeps the most likely token
            u = torch.tensor([uniform(seeds[i], positions[i]) for i in trunc], device=device, dtype=torch.float64)
            cdf = torch.cumsum(torch.where(keep, probs, 0.0).double(), dim=-1)
            tokens[idx] = order.gather(1, _draw(cdf, u)[:, None])[:, 0]
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        return tokens.tolist(), chosen.tolist()


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: first index whose cumulative mass exceeds u * total (never a zero-mass token)."""
    x = (u * cdf[:, -1]).contiguous()[:, None]  # [n, 1]
    idx = torch.searchsorted(cdf.contiguous(), x, right=True)[:, 0]
    return idx.clamp_(max=cdf.shape[-1] - 1)
