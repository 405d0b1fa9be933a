"""Sampler specs: the fast draws (two-level CDF, partial-sort top-k / top-p) equal the plain
full-vocabulary definitions, never pick a token without mass, and sample the right distribution."""

import math

import pytest
import torch

from staleflow.rollout.engine import SamplingParams
from staleflow.rollout.sampler import Sampler, _draw, draw_chunked, draw_truncated, truncation_mask


def full_cdf_draw(probs, u):
    return _draw(torch.cumsum(probs.double(), -1), u)


def full_sort_truncated(probs, u, top_k, top_p):
    """The definition: sort everything, keep the prefix, inverse CDF over the kept tokens in
    vocabulary order."""
    vocab = probs.shape[1]
    sorted_p, order = torch.sort(probs, stable=True, dim=-1, descending=True)
    keep = torch.arange(vocab)[None] < torch.where(top_k > 0, top_k, vocab)[:, None]
    keep &= (torch.cumsum(sorted_p.double(), -1) - sorted_p.double()) < top_p[:, None]
    kept = torch.zeros_like(keep).scatter(1, order, keep)  # back to vocabulary order
    return full_cdf_draw(torch.where(kept, probs, 0.0), u), kept


def distributions(vocab, rows=24, seed=0):
    """Rows from nearly flat to very peaked (the peaked ones settle on topk(64), the flat ones
    go through the bucket search), a few with masked (zero-mass) tokens."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.3, rows)[:, None]
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[::5, ::3] = -math.inf
    return logits.softmax(-1), torch.rand(rows, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("vocab", [7, 1000, 1024, 5000, 49152])
def test_two_level_draw_equals_full_cdf_and_skips_zero_mass(vocab):
    probs, u = distributions(vocab)
    tokens = draw_chunked(probs, u)
    assert torch.equal(tokens, full_cdf_draw(probs, u))
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())


@pytest.mark.parametrize("vocab", [50, 3000, 49152])
def test_partial_sort_truncation_equals_full_sort(vocab):
    probs, u = distributions(vocab, seed=1)
    rows = probs.shape[0]
    top_k = torch.tensor([0, 1, 5, 0, 100, 2000][:rows] * (rows // 6))
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 1.0, 0.95] * (rows // 6), dtype=torch.float64)
    expected, kept = full_sort_truncated(probs, u, top_k, top_p)
    assert torch.equal(truncation_mask(probs, top_k, top_p), kept)
    tokens = draw_truncated(probs, u, top_k, top_p)
    assert torch.equal(tokens, expected)
    assert bool(kept.gather(1, tokens[:, None]).all())


def test_u_next_to_one_never_lands_on_padding_or_masked_tokens():
    vocab = 1500  # not a multiple of the 1024-token chunk: the last chunk is padded with zeros
    probs = torch.zeros(3, vocab)
    probs[0, :10] = 0.1
    probs[1, 1024:1030] = 1 / 6
    probs[2, 7] = 1.0
    u = torch.full((3,), 1 - 2.0**-53, dtype=torch.float64)
    assert draw_chunked(probs, u).tolist() == [9, 1029, 7]
    top = draw_truncated(probs, u, torch.tensor([0, 3, 0]), torch.tensor([0.25, 1.0, 1.0], dtype=torch.float64))
    assert bool((probs.gather(1, top[:, None]) > 0).all())


def test_sampled_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    n = 20000
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8)):
        params = [SamplingParams(temperature=temperature, top_p=top_p)] * n
        tokens, logprobs = Sampler()(logits.expand(n, -1), params, [123] * n, list(range(n)))
        probs = (logits[0] / temperature).softmax(-1)
        # the log-prob reported is the untruncated tempered one, whatever was kept
        assert logprobs[0] == pytest.approx(math.log(probs[tokens[0]]), abs=1e-5)
        if top_p < 1:  # keeps 0 and 1 (0.665 before 2), renormalised
            probs = torch.tensor([probs[0], probs[1], 0, 0, 0]) / (probs[0] + probs[1])
        freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
        assert torch.allclose(freq, probs.double(), atol=0.015), (temperature, top_p, freq, probs)


def test_kept_set_of_a_row_does_not_depend_on_the_rows_before_it():
    """A flat row whose top-p cut falls exactly on a token boundary keeps the same set alone and
    after a row of tiny probabilities (prefix sums are per row, not across the batch)."""
    vocab = 4096
    flat = torch.full((vocab,), 2.0**-12)  # top_p 0.5: exactly 2048 tokens have less than 0.5 before them
    g = torch.Generator().manual_seed(0)
    top_k, top_p = torch.tensor([100, 0]), torch.tensor([1.0, 0.5], dtype=torch.float64)
    alone = truncation_mask(flat[None], top_k[1:], top_p[1:])[0]
    assert int(alone.sum()) == 2048
    for _ in range(20):
        tiny = torch.empty(vocab)
        tiny[:10] = 0.09
        tiny[10:] = 2.0**-40 * (1 + 0.1 * torch.rand(vocab - 10, generator=g))
        assert torch.equal(truncation_mask(torch.stack([tiny, flat]), top_k, top_p)[1], alone)
