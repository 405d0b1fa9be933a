"""Sampler: next tokens and their log-probs from a batch of logits, one SamplingParams per row.

Per row r with temperature t_r (greedy rows use t = 1 for their log-prob):
1. logprobs = log_softmax(logits / t) in fp32                       [N, V]
2. the returned log-prob of the chosen token is logprobs[r, token]: the temperature-scaled,
   UNtruncated distribution. That is what the trainer recomputes (log_softmax(logits / t) of
   the same tokens), so behaviour and trainer log-probs agree up to float rounding; top-p /
   top-k only restrict which tokens may be drawn (the usual RL convention, as in verl/vLLM's
   "raw" log-probs; the truncated log-prob would differ from the trainer's by the log of the
   kept mass).
3. greedy rows: argmax; other rows: inverse-CDF sampling with one uniform u per row. Without
   truncation the CDF is walked in two levels (fp64 sums of 1024-token chunks, then one
   chunk), not one fp64 cumsum over the vocabulary. With top-k / top-p the kept set is the
   prefix of the tokens sorted by probability, found without a full sort (`truncation_mask`:
   a 32 x 49k sort costs ~175 ms on one CPU core), then drawn from in vocabulary order.
The per-row parameters (temperatures, uniforms, top-k / top-p, row indices) go to the device in one
non-blocking copy from a pinned buffer (``HostStaging``), and the step's tokens and log-probs reach
the host in one transfer (the engine must emit them): on CUDA nothing else waits for the device.
u is a counter-based hash of (request seed, output position): it does not depend on the
batch, the device or on how many steps ran before, so a seeded request samples the same
tokens alone, in any batch, and after an abort + resume.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from staleflow.rollout.engine import SamplingParams
from staleflow.rollout.staging import HostStaging

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


_CHUNK = 1024
"""Tokens per chunk of the two-level inverse CDF."""
_TOPK_TRY = 64
"""The partial sort tried first for a top-p / top-k kept set (settles peaked rows)."""
_BUCKET_SHIFT = 20
"""Low float bits dropped to bucket probabilities (11 bits left: exponent + 3 mantissa bits)."""


class Sampler:
    def __init__(self):
        self.staging: HostStaging | None = None
        """The per-row parameters' one host-to-device copy (made for the logits' device on first use)."""

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
    ) -> tuple[list[int], list[float]]:
        """logits [N, V] (any float dtype) -> (tokens, log-probs) for the N rows."""
        n = logits.shape[0]
        device = logits.device
        if self.staging is None or self.staging.device != device:
            self.staging = HostStaging(device, torch.float64)
        logits = logits.float()
        temps = [1.0 if p.temperature == 0 else p.temperature for p in params]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        plain = [i for i, p in enumerate(params) if not p.greedy and p.top_p >= 1.0 and p.top_k == 0]
        trunc = [i for i, p in enumerate(params) if not p.greedy and (p.top_p < 1.0 or p.top_k > 0)]
        scale = not all(t == 1.0 for t in temps)
        # every per-row value the device needs, in one fp64 upload (indices and top-k are exact in fp64)
        (t_d, g_idx, p_idx, p_u, t_idx, t_u, t_k, t_p) = self.staging.upload(
            [
                temps if scale else [],
                greedy if 0 < len(greedy) < n else [],
                plain if 0 < len(plain) < n else [],
                [uniform(seeds[i], positions[i]) for i in plain],
                trunc,
                [uniform(seeds[i], positions[i]) for i in trunc],
                [params[i].top_k for i in trunc],
                [params[i].top_p for i in trunc],
            ]
        )
        scaled = logits / t_d.float()[:, None] if scale else logits
        logprobs = torch.log_softmax(scaled, dim=-1)  # [N, V]
        tokens = torch.empty(n, dtype=torch.long, device=device)
        if len(greedy) == n:
            tokens = logits.argmax(dim=-1)
        elif greedy:
            idx = g_idx.long()
            tokens[idx] = logits[idx].argmax(dim=-1)
        if plain:
            if len(plain) == n:
                tokens = draw_chunked(logprobs.exp(), p_u)
            else:
                idx = p_idx.long()
                tokens[idx] = draw_chunked(logprobs[idx].exp(), p_u)
        if trunc:
            idx = t_idx.long()
            tokens[idx] = draw_truncated(logprobs[idx].exp(), t_u, t_k.long(), t_p)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        # the step's one device -> host transfer: tokens (exact in fp64) and their log-probs together
        both = torch.stack((tokens.double(), chosen.double())).tolist()
        return [int(t) for t in both[0]], both[1]


def draw_chunked(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over [n, V] non-negative probs: the first token whose cumulative mass exceeds
    u * total, found in two levels (fp64 chunk sums, then the fp64 cumsum of one chunk).

    A zero-mass token is never returned. Each row depends on that row only (batch invariant).
    """
    n, vocab = probs.shape
    pad = (-vocab) % _CHUNK
    chunks = (F.pad(probs, (0, pad)) if pad else probs).view(n, -1, _CHUNK)  # [n, C, CHUNK]
    ccdf = chunks.sum(-1, dtype=torch.float64).cumsum(-1)  # [n, C]
    x = _below(u, ccdf[:, -1])
    c = torch.searchsorted(ccdf, x[:, None], right=True)[:, 0]
    before = torch.where(c > 0, ccdf.gather(1, (c - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    chunk = chunks[torch.arange(n, device=probs.device), c]  # [n, CHUNK]
    inner = chunk.double().cumsum(-1)
    j = torch.searchsorted(inner, (x - before)[:, None], right=True)[:, 0]
    # the chunk's own cumsum can end a rounding error below its chunk sum: never step past the
    # chunk's last token with mass
    last = _CHUNK - 1 - (chunk.flip(-1) > 0).to(torch.uint8).argmax(-1)
    return c * _CHUNK + torch.minimum(j, last)


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [n, V]: each row's top-k / top-p kept set (top_k 0 = no limit, top_p 1 = no limit).

    Kept set: the longest prefix of the tokens sorted by probability whose members each have
    fewer than `top_k` tokens and less than `top_p` mass before them (the most likely token is
    always kept); among exactly equal probabilities at the edge, any may be kept. Found
    without sorting the vocabulary:
    1. topk(64): a row is settled once top_k <= 64 or its 64 largest probabilities hold top_p;
    2. other rows: the probabilities' float bits (monotone for p >= 0) are bucketed by exponent
       and 3 mantissa bits; per-bucket fp64 mass and counts locate the one bucket where the
       prefix ends, and only that bucket's tokens are sorted.
    """
    n, vocab = probs.shape
    device = probs.device
    k_limit = torch.where(top_k > 0, top_k, vocab)
    keep = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    k = min(_TOPK_TRY, vocab)
    vals, order = torch.topk(probs, k, dim=-1)  # sorted, descending
    mass = vals.double().cumsum(-1)
    in_prefix = torch.arange(k, device=device)[None, :] < k_limit[:, None]
    in_prefix &= (mass - vals.double()) < top_p[:, None]
    settled = (k_limit <= k) | (mass[:, -1] >= top_p)
    keep.scatter_(1, order, in_prefix & settled[:, None])
    idx = (~settled).nonzero()[:, 0]
    if not idx.numel():
        return keep
    r = idx.numel()
    p = probs if r == n else probs[idx]
    nb = 1 << (31 - _BUCKET_SHIFT)
    bucket = torch.bitwise_right_shift(p.view(torch.int32), _BUCKET_SHIFT)  # [r, V] int32
    flat = (bucket + torch.arange(r, device=device, dtype=torch.int32)[:, None] * nb).view(-1)
    b_mass = torch.bincount(flat, weights=p.reshape(-1).double(), minlength=r * nb).view(r, nb)
    if bool((k_limit[idx] < vocab).any()):
        b_count = torch.bincount(flat, minlength=r * nb).view(r, nb)
    else:  # no top-k among these rows: counts never decide
        b_count = torch.zeros(r, nb, dtype=torch.long, device=device)
    # inclusive mass / count of all buckets >= b, walking down from the top bucket
    mass_desc = b_mass.flip(-1).cumsum(-1)
    count_desc = b_count.flip(-1).cumsum(-1)
    top_p, k_limit = top_p[idx], k_limit[idx]
    cross = (mass_desc >= top_p[:, None]) | (count_desc >= k_limit[:, None])
    j = cross.to(torch.uint8).argmax(-1)  # first crossing, walking down
    never = ~cross.any(-1)  # the whole vocabulary holds less than top_p (rounding): keep all
    b_star = torch.where(never, -1, nb - 1 - j)
    jm1 = (j - 1).clamp(min=0)[:, None]
    mass_above = torch.where(j > 0, mass_desc.gather(1, jm1)[:, 0], 0.0)
    count_above = torch.where(j > 0, count_desc.gather(1, jm1)[:, 0], 0)
    keep[idx] = bucket > b_star[:, None]
    # the crossing bucket: sort its tokens by (row, probability descending, token id)
    c_rows, c_cols = (bucket == b_star[:, None]).nonzero(as_tuple=True)
    c_vals = p[c_rows, c_cols]
    o = torch.sort(c_vals, stable=True, descending=True).indices
    o = o[torch.sort(c_rows[o], stable=True).indices]
    c_rows, c_cols, c_vals = c_rows[o], c_cols[o], c_vals[o].double()
    starts = torch.searchsorted(c_rows, torch.arange(r, device=device))  # segment starts
    rank = torch.arange(c_rows.numel(), device=device) - starts[c_rows]
    # per-row prefix sums (a cumsum across rows would let one row's rounding move another's cut)
    width = int(rank.max()) + 1 if rank.numel() else 0
    dense = torch.zeros(r, width, dtype=torch.float64, device=device).index_put_((c_rows, rank), c_vals)
    before = mass_above[c_rows] + dense.cumsum(1)[c_rows, rank] - c_vals
    ok = (before < top_p[c_rows]) & (count_above[c_rows] + rank < k_limit[c_rows])
    keep[idx[c_rows[ok]], c_cols[ok]] = True
    return keep


def truncation_mask_sorted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The kept set of `truncation_mask` from one full sort: no host synchronisation (the bucket
    search sizes tensors from device values), the CUDA path, where a sort of the vocabulary is cheap."""
    n, vocab = probs.shape
    k_limit = torch.where(top_k > 0, top_k, vocab)
    vals, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass = vals.double().cumsum(-1)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    kept = (rank < k_limit[:, None]) & ((mass - vals.double()) < top_p[:, None])
    kept[:, 0] = True  # the most likely token is always kept
    return torch.zeros_like(kept).scatter_(1, order, kept)


def draw_truncated(probs: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Inverse CDF (vocabulary order) over each row's kept set (`truncation_mask`; on CUDA the
    sort-based `truncation_mask_sorted`, which never waits for the device)."""
    mask = (truncation_mask_sorted if probs.is_cuda else truncation_mask)(probs, top_k, top_p)
    return draw_chunked(torch.where(mask, probs, 0.0), u)


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: first index whose cumulative mass exceeds u * total (never a zero-mass token)."""
    x = _below(u, cdf[:, -1]).contiguous()[:, None]  # [n, 1]
    return torch.searchsorted(cdf.contiguous(), x, right=True)[:, 0]


def _below(u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """u * total, kept strictly below total (u close to 1 can round up to it)."""
    return torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
