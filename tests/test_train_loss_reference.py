"""Losses and aggregations against an independent reference written from the papers' formulas.

The reference lays a batch out the way TRL and verl do, as [B, T] padded float64 tensors with a
response mask, and follows the published definitions (no code shared with staleflow.train.losses):

    token-mean               sum(l * m) / sum(m)                         DAPO; TRL "dapo"/"bnpo"; verl "token-mean"
    seq-mean                 mean_B(sum_T(l * m) / max(sum_T(m), 1))      GRPO; TRL "grpo"; verl "seq-mean-token-mean"
    seq-mean-token-sum       mean_B(sum_T(l * m))                         verl "seq-mean-token-sum"
    seq-mean-token-sum-norm  sum(l * m) / (B * L_max)                     Dr. GRPO; TRL "dr_grpo"

B counts every row, empty completions included (the papers' 1/G, TRL's mean over the batch).
Per token: PPO-clip on r = pi/pi_old (GSPO: the GSPO-token ratio sg[s_i] pi/sg[pi] with
s_i = (pi(y_i)/pi_old(y_i))^(1/|y_i|)); importance weights from rho = pi_prox/mu: truncated
min(rho, C), masked rho * 1[lo <= rho <= hi], per token or per sequence (product of the token
ratios; geometric mean for mis-seq-geo); k3 KL; entropy bonus.
"""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.train import losses
from staleflow.train.losses import (
    AGGREGATIONS,
    OFF_POLICY,
    LossInputs,
    LossSettings,
    policy_loss,
    resolve_loss_agg,
    token_weights,
)

L_MAX = 8


def _inputs(lengths: list[int], seed: int) -> LossInputs:
    """Packed float64 inputs for sequences of these response lengths (zeros allowed: no tokens)."""
    g = torch.Generator().manual_seed(seed)
    seq_index = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)])
    n = len(seq_index)
    d = dict(dtype=torch.float64)
    prox = -torch.rand(n, generator=g, **d) * 3
    return LossInputs(
        logp=(prox + 0.3 * torch.randn(n, generator=g, **d)).clamp(max=0).requires_grad_(),
        behaviour_logp=prox + 0.4 * torch.randn(n, generator=g, **d),
        proximal_logp=prox,
        advantages=torch.randn(len(lengths), generator=g, **d)[seq_index],
        token_weight=torch.zeros(n, **d),
        seq_index=seq_index,
        num_seqs=len(lengths),
        entropy=torch.rand(n, generator=g, **d) * 2,
        ref_logp=prox - 0.2 * torch.randn(n, generator=g, **d),
    )


def _pad(v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Packed [N] -> padded [B, T] (zeros past each length); differentiable in v."""
    rows = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)])
    cols = torch.cat([torch.arange(n) for n in lengths])
    return torch.zeros(len(lengths), max(max(lengths), 1), dtype=v.dtype).index_put((rows, cols), v)


def _ref_loss(s: LossSettings, agg: str, x: LossInputs, lengths: list[int]) -> torch.Tensor:
    m = _pad(torch.ones(len(x.seq_index), dtype=torch.float64), lengths)  # [B, T] response mask
    n_i = m.sum(-1, keepdim=True)  # [B, 1]
    cur, mu, prox, adv = (_pad(t, lengths) for t in (x.logp, x.behaviour_logp, x.proximal_logp, x.advantages))
    log_rho = (prox - mu) * m
    token_rho, seq_rho = torch.exp(log_rho), torch.exp(log_rho.sum(-1, keepdim=True))
    geo_rho = torch.exp(log_rho.sum(-1, keepdim=True) / n_i.clamp(min=1))
    masked = lambda rho: torch.where((rho >= s.is_low) & (rho <= s.is_high), rho, 0.0)  # noqa: E731
    w = {
        "none": torch.ones_like(m),
        "tis-token": token_rho.clamp(max=s.is_cap),
        "decoupled": token_rho.clamp(max=s.is_cap),
        "tis-seq": seq_rho.clamp(max=s.is_cap).expand_as(m),
        "mis-token": masked(token_rho),
        "mis-seq": masked(seq_rho).expand_as(m),
        "mis-seq-geo": masked(geo_rho).expand_as(m),
    }[s.off_policy]
    old = mu if s.off_policy == "none" else prox
    if s.loss == "gspo":
        log_s = ((cur - old) * m).sum(-1, keepdim=True) / n_i.clamp(min=1)
        ratio = torch.exp(log_s.detach()) * torch.exp(cur) / torch.exp(cur).detach()
    else:
        ratio = torch.exp(cur - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - s.clip_low, 1 + s.clip_high))
    k3 = torch.exp(_pad(x.ref_logp, lengths) - cur) - (_pad(x.ref_logp, lengths) - cur) - 1
    per_token = w * pg + s.kl_coef * k3 - s.entropy_coef * _pad(x.entropy, lengths)
    per_token = per_token * m
    if agg == "token-mean":
        return per_token.sum() / m.sum().clamp(min=1)
    if agg == "seq-mean":
        return (per_token.sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if agg == "seq-mean-token-sum":
        return per_token.sum(-1).mean()
    return per_token.sum() / (len(lengths) * L_MAX)


def _ours(s: LossSettings, agg: str, x: LossInputs, lengths: list[int]) -> torch.Tensor:
    weights = torch.tensor(token_weights(agg, lengths, L_MAX), dtype=torch.float64)
    x.token_weight = weights[x.seq_index]
    return policy_loss(s, x)[0]


LENGTHS = st.lists(st.integers(0, L_MAX), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(
    LENGTHS,
    st.sampled_from(AGGREGATIONS),
    st.sampled_from(["grpo", "gspo"]),
    st.sampled_from(OFF_POLICY),
    st.integers(0, 10**6),
)
def test_loss_and_gradient_match_the_padded_reference(lengths, agg, loss, off_policy, seed):
    s = LossSettings(
        loss=loss,
        off_policy=off_policy,
        clip_low=0.2,
        clip_high=0.28,
        is_cap=1.5,
        is_low=0.7,
        is_high=1.4,
        kl_coef=0.05,
        kl_estimator="k3",
        entropy_coef=0.01,
    )
    x = _inputs(lengths, seed)
    ours, ref = _ours(s, agg, x, lengths), _ref_loss(s, agg, x, lengths)
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-9, abs=1e-12)
    if sum(lengths):
        (g_ours,) = torch.autograd.grad(ours, x.logp)
        (g_ref,) = torch.autograd.grad(ref, x.logp)
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-9, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, L_MAX), min_size=1, max_size=6), st.integers(0, 10**6))
def test_gspo_token_form_under_seq_mean_is_the_gspo_sequence_objective(lengths, seed):
    """GSPO paper: J = 1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log(pi/pi_old)); same value and gradient."""
    s = LossSettings(loss="gspo", off_policy="tis-seq", clip_low=3e-4, clip_high=4e-4, is_cap=2.0)
    x = _inputs(lengths, seed)
    ours = _ours(s, "seq-mean", x, lengths)
    m = _pad(torch.ones(len(x.seq_index), dtype=torch.float64), lengths)
    cur, prox, mu = (_pad(t, lengths) for t in (x.logp, x.proximal_logp, x.behaviour_logp))
    s_i = torch.exp(((cur - prox) * m).sum(-1) / m.sum(-1))  # [B]
    w_i = torch.exp(((prox - mu) * m).sum(-1)).clamp(max=2.0)  # sequence-level truncated IS weight
    a_i = _pad(x.advantages, lengths)[:, 0]
    per_seq = w_i * torch.maximum(-a_i * s_i, -a_i * s_i.clamp(1 - 3e-4, 1 + 4e-4))
    ref = per_seq.mean()
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-9)
    torch.testing.assert_close(
        torch.autograd.grad(ours, x.logp)[0], torch.autograd.grad(ref, x.logp)[0], rtol=1e-9, atol=1e-12
    )


@settings(max_examples=60, deadline=None)
@given(LENGTHS, st.integers(1, 4), st.sampled_from(AGGREGATIONS), st.integers(0, 10**6))
def test_empty_completions_count_as_sequences_not_as_tokens(lengths, empties, agg, seed):
    """k more empty completions: token-mean unchanged (no tokens); every per-sequence mean scaled by S/(S+k)."""
    s = LossSettings(loss="grpo", off_policy="tis-token")
    x = _inputs(lengths, seed)
    base = float(_ours(s, agg, x, lengths).detach())
    more = float(_ours(s, agg, x, lengths + [0] * empties).detach())
    scale = 1.0 if agg == "token-mean" else len(lengths) / (len(lengths) + empties)
    assert more == pytest.approx(base * scale, rel=1e-12, abs=1e-15)


@given(st.integers(0, L_MAX), LENGTHS, LENGTHS)
def test_dr_grpo_token_weight_does_not_depend_on_the_other_lengths(mine, others_a, others_b):
    """The Dr. GRPO normaliser is the constant S * L_max: with as many sequences, the other
    completions' lengths (or emptiness) never change a token's weight; token-mean's 1/N does."""
    others_b = (others_b * len(others_a))[: len(others_a)]  # same S, other lengths
    w_a = token_weights("seq-mean-token-sum-norm", [max(mine, 1)] + others_a, L_MAX)[0]
    w_b = token_weights("seq-mean-token-sum-norm", [max(mine, 1)] + others_b, L_MAX)[0]
    assert w_a == w_b == 1.0 / ((1 + len(others_a)) * L_MAX)
    if sum(others_a) != sum(others_b):
        assert token_weights("token-mean", [1] + others_a)[0] != token_weights("token-mean", [1] + others_b)[0]


def test_auto_aggregation_follows_the_papers():
    assert resolve_loss_agg("gspo", "grpo", "auto") == "seq-mean"
    assert resolve_loss_agg("grpo", "dr-grpo", "auto") == "seq-mean-token-sum-norm"
    assert resolve_loss_agg("grpo", "grpo", "auto") == "token-mean"
    assert resolve_loss_agg("gspo", "dr-grpo", "auto") == "seq-mean"  # the loss's own objective wins
    with pytest.raises(ValueError, match="loss_agg='mean'.*--train.loss-agg"):
        resolve_loss_agg("grpo", "grpo", "mean")


@pytest.mark.parametrize(
    "loss, advantage, agg, words",
    [
        ("gspo", "grpo", "token-mean", "GSPO's objective is a mean over sequences"),
        ("gspo", "grpo", "seq-mean-token-sum", "weights each sequence by its length"),
        ("grpo", "dr-grpo", "token-mean", "Dr. GRPO also normalises the loss by a constant"),
    ],
)
def test_departures_from_the_paper_warn_once(monkeypatch, loss, advantage, agg, words):
    monkeypatch.setattr(losses, "_warned", set())
    with pytest.warns(UserWarning, match=words):
        assert resolve_loss_agg(loss, advantage, agg) == agg  # the run does what was asked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_loss_agg(loss, advantage, agg)  # once per process


@pytest.mark.parametrize(
    "loss, advantage, agg",
    [("gspo", "grpo", "seq-mean"), ("grpo", "grpo", "token-mean"), ("grpo", "dr-grpo", "seq-mean-token-sum-norm")],
)
def test_paper_combinations_do_not_warn(monkeypatch, loss, advantage, agg):
    monkeypatch.setattr(losses, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_loss_agg(loss, advantage, agg) == agg


def test_reference_sanity_on_a_hand_computed_batch():
    """Guards the reference itself: two sequences (2 tokens, empty), on-policy, A = 1, per-token loss -1."""
    x = _inputs([2, 0], seed=0)
    with torch.no_grad():
        x.logp.copy_(x.proximal_logp)
    x.behaviour_logp = x.proximal_logp.clone()
    x.advantages = torch.ones(2, dtype=torch.float64)
    s = LossSettings(loss="grpo", off_policy="tis-token")
    expected = {
        "token-mean": -1.0,
        "seq-mean": -0.5,
        "seq-mean-token-sum": -1.0,
        "seq-mean-token-sum-norm": -2.0 / (2 * L_MAX),
    }
    for agg, value in expected.items():
        assert float(_ref_loss(s, agg, x, [2, 0]).detach()) == pytest.approx(value), agg
        assert float(_ours(s, agg, x, [2, 0]).detach()) == pytest.approx(value), agg
    assert math.isfinite(float(_ours(s, "seq-mean", x, [2, 0]).detach()))
