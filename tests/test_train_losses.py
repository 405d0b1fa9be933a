"""Advantage estimators, DAPO helpers, policy losses and off-policy corrections vs straightforward references."""

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.train.advantages import compute_advantages, groups_with_signal, overlong_penalty
from staleflow.train.losses import OFF_POLICY, LossInputs, LossSettings, importance_weights, policy_loss, token_weights

# ---- advantages ---------------------------------------------------------------------------------


def _ref_adv(name, rewards, groups):
    out = []
    for r, g in zip(rewards, groups):
        mates = [x for x, h in zip(rewards, groups) if h == g]
        n, mean = len(mates), sum(mates) / len(mates)
        if name == "grpo":
            if n < 2:
                out.append(0.0)
                continue
            std = math.sqrt(sum((x - mean) ** 2 for x in mates) / (n - 1))
            out.append((r - mean) / (std + 1e-6))
        elif name in ("grpo-nostd", "dr-grpo"):
            out.append(r - mean)
        else:  # rloo: minus the mean of the others
            out.append(0.0 if n < 2 else r - (sum(mates) - r) / (n - 1))
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5)), min_size=1, max_size=20),
    st.sampled_from(["grpo", "grpo-nostd", "dr-grpo", "rloo"]),
)
def test_advantages_match_reference(items, name):
    groups, rewards = [g for g, _ in items], [r for _, r in items]
    got = compute_advantages(name, rewards, groups)
    assert got == pytest.approx(_ref_adv(name, rewards, groups), abs=1e-6, rel=1e-6)
    for g in set(groups):  # centred within every group
        assert abs(sum(a for a, h in zip(got, groups) if h == g)) < 1e-8


def test_all_equal_rewards_give_zero_advantage_and_are_filtered():
    rewards, groups = [1.0, 1.0, 1.0, 0.0, 1.0], ["a", "a", "a", "b", "b"]
    for name in ("grpo", "grpo-nostd", "dr-grpo", "rloo"):
        assert compute_advantages(name, rewards, groups)[:3] == [0.0, 0.0, 0.0]
    assert groups_with_signal(rewards, groups) == [False, False, False, True, True]
    assert compute_advantages("grpo", [3.0], ["x"]) == [0.0]


def test_advantage_errors_name_the_problem():
    with pytest.raises(ValueError, match="advantage='ppo-gae'"):
        compute_advantages("ppo-gae", [1.0], [0])
    with pytest.raises(ValueError, match="finite"):
        compute_advantages("grpo", [float("nan")], [0])
    with pytest.raises(ValueError, match="group ids"):
        compute_advantages("grpo", [1.0, 2.0], [0])


def test_overlong_penalty_ramp():
    assert overlong_penalty(10, 0, 0) == 0.0  # disabled
    assert overlong_penalty(60, 100, 40) == 0.0
    assert overlong_penalty(80, 100, 40) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 40) == pytest.approx(-1.0)
    assert overlong_penalty(130, 100, 40) == -1.0
    with pytest.raises(ValueError, match="cache_tokens=120"):
        overlong_penalty(1, 100, 120)


# ---- aggregation ----------------------------------------------------------------------------------


def test_token_weights_aggregations():
    # The empty completion is one of the S = 3 sampled sequences (it used to be left out: S = 2).
    lengths = [2, 0, 4]
    assert token_weights("token-mean", lengths) == [1 / 6] * 3
    assert token_weights("seq-mean", lengths) == pytest.approx([1 / 6, 0.0, 1 / 12])
    assert token_weights("seq-mean-token-sum", lengths) == pytest.approx([1 / 3] * 3)
    assert token_weights("seq-mean-token-sum-norm", lengths, max_response_tokens=8) == pytest.approx([1 / 24] * 3)
    assert token_weights("token-mean", [0, 0]) == [0.0, 0.0]  # fully empty: no loss, no NaN
    with pytest.raises(ValueError, match="loss_agg='sum'"):
        token_weights("sum", lengths)
    with pytest.raises(ValueError, match="max_response_tokens=None.*--rollout.max-new-tokens"):
        token_weights("seq-mean-token-sum-norm", lengths)


# ---- losses -----------------------------------------------------------------------------------------


def _batch(seed=0, lens=(3, 1, 5, 2), same=False, gap=0.3):
    g = torch.Generator().manual_seed(seed)
    seq_index = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    N = len(seq_index)
    logp = (-torch.rand(N, generator=g) * 3).requires_grad_()
    prox = logp.detach().clone()
    beh = prox.clone() if same else prox + gap * torch.randn(N, generator=g)
    adv = torch.randn(len(lens), generator=g)[seq_index]
    w = torch.tensor(token_weights("seq-mean", list(lens)))[seq_index]
    return LossInputs(
        logp=logp,
        behaviour_logp=beh,
        proximal_logp=prox,
        advantages=adv,
        token_weight=w,
        seq_index=seq_index,
        num_seqs=len(lens),
        entropy=torch.rand(N, generator=g) * 2,
        ref_logp=prox - 0.1 * torch.randn(N, generator=g),
    )


def _ref_per_token(s: LossSettings, x: LossInputs, i: int, cur: torch.Tensor) -> float:
    """Straightforward per-token loop of the documented formulas (float64)."""
    seq = int(x.seq_index[i])
    members = [j for j in range(len(x.seq_index)) if int(x.seq_index[j]) == seq]
    lr = lambda j: float(x.proximal_logp[j]) - float(x.behaviour_logp[j])  # noqa: E731
    if s.off_policy == "none":
        w = 1.0
    elif s.off_policy in ("tis-token", "decoupled"):
        w = min(math.exp(lr(i)), s.is_cap)
    elif s.off_policy == "tis-seq":
        w = min(math.exp(sum(lr(j) for j in members)), s.is_cap)
    else:
        rho = {
            "mis-token": math.exp(lr(i)),
            "mis-seq": math.exp(sum(lr(j) for j in members)),  # product of the token ratios
            "mis-seq-geo": math.exp(sum(lr(j) for j in members) / len(members)),
        }[s.off_policy]
        w = rho if s.is_low <= rho <= s.is_high else 0.0
    old = x.behaviour_logp if s.off_policy == "none" else x.proximal_logp
    a = float(x.advantages[i])
    if s.loss == "gspo":
        ratio = math.exp(sum(float(cur[j]) - float(old[j]) for j in members) / len(members))
    else:
        ratio = math.exp(float(cur[i]) - float(old[i]))
    clipped = min(max(ratio, 1 - s.clip_low), 1 + s.clip_high)
    l_tok = w * max(-a * ratio, -a * clipped)
    d = float(x.ref_logp[i]) - float(cur[i])
    kl = -d if s.kl_estimator == "k1" else math.exp(d) - d - 1
    return l_tok + s.kl_coef * kl - s.entropy_coef * float(x.entropy[i])


@pytest.mark.parametrize("loss", ["grpo", "gspo"])  # dapo is a recipe (clip-higher is set here), not a loss
@pytest.mark.parametrize("off_policy", OFF_POLICY)
def test_loss_value_matches_reference(loss, off_policy):
    s = LossSettings(
        loss=loss,
        off_policy=off_policy,
        clip_low=0.2,
        clip_high=0.28,
        is_cap=1.5,
        is_low=0.8,
        is_high=1.25,
        kl_coef=0.05,
        kl_estimator="k3",
        entropy_coef=0.01,
    )
    x = _batch(seed=zlib.crc32(f"{loss}/{off_policy}".encode()) % 1000)
    with torch.no_grad():  # move the current policy away from the proximal one so clipping bites
        x.logp += 0.4 * torch.randn(x.logp.shape, generator=torch.Generator().manual_seed(7))
    loss_v, stats = policy_loss(s, x)
    cur = x.logp.detach()
    ref = sum(_ref_per_token(s, x, i, cur) * float(x.token_weight[i]) for i in range(len(cur)))
    assert float(loss_v.detach()) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert 0 <= float(stats["ppo_clipped_frac"]) <= len(cur)


def test_loss_gradient_matches_finite_differences_fp64():
    s = LossSettings(loss="grpo", off_policy="tis-seq", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.0)
    x = _batch(seed=3)
    x.logp = x.logp.detach().double().requires_grad_()
    for f in ("behaviour_logp", "proximal_logp", "advantages", "token_weight", "ref_logp"):
        setattr(x, f, getattr(x, f).double())
    with torch.no_grad():
        x.logp += 0.05
    torch.autograd.gradcheck(lambda lp: policy_loss(s, LossInputs(**{**vars(x), "logp": lp}))[0], (x.logp,))


@pytest.mark.parametrize("off_policy", OFF_POLICY)
@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_on_policy_weights_are_one_and_gradient_is_plain_policy_gradient(off_policy, loss):
    x = _batch(seed=11, same=True)
    s = LossSettings(loss=loss, off_policy=off_policy)
    w, truncated, rejected = importance_weights(s, x)
    assert bool((w == 1.0).all()) and not truncated.any() and not rejected.any()
    loss_v, _ = policy_loss(s, x)
    (g,) = torch.autograd.grad(loss_v, x.logp)
    # plain policy gradient: d/dlogp of -sum_t weight_t * A_t * logp_t
    torch.testing.assert_close(g, -x.advantages * x.token_weight, atol=1e-7, rtol=1e-6)


def test_masked_is_rejects_outside_bounds_and_truncation_caps():
    x = _batch(seed=5, lens=(1, 1, 1), gap=0.0)
    x.behaviour_logp = x.proximal_logp - torch.log(torch.tensor([0.3, 1.1, 4.0]))  # rho = 0.3, 1.1, 4.0
    w, _, rej = importance_weights(LossSettings(off_policy="mis-token", is_low=0.5, is_high=2.0), x)
    assert rej.tolist() == [True, False, True]
    torch.testing.assert_close(w, torch.tensor([0.0, 1.1, 0.0]))
    w, trunc, _ = importance_weights(LossSettings(off_policy="tis-token", is_cap=2.0), x)
    assert trunc.tolist() == [False, False, True]
    torch.testing.assert_close(w, torch.tensor([0.3, 1.1, 2.0]))


def test_sequence_masked_is_uses_the_product_and_geo_the_geometric_mean():
    # Three tokens, each rho = 1.5 (inside [0.5, 2]); the sequence's likelihood ratio is 1.5^3 = 3.375.
    x = _batch(seed=8, lens=(3, 1), gap=0.0)
    x.behaviour_logp = x.proximal_logp - math.log(1.5)
    s = dict(is_low=0.5, is_high=2.0)
    w, _, rejected = importance_weights(LossSettings(off_policy="mis-seq", **s), x)
    assert rejected.tolist() == [True, True, True, False] and w.tolist() == pytest.approx([0, 0, 0, 1.5])
    w, _, rejected = importance_weights(LossSettings(off_policy="mis-seq-geo", **s), x)
    assert not rejected.any() and w.tolist() == pytest.approx([1.5] * 4)
    w, truncated, _ = importance_weights(LossSettings(off_policy="tis-seq", is_cap=3.0), x)
    assert truncated.tolist() == [True, True, True, False] and w.tolist() == pytest.approx([3.0, 3.0, 3.0, 1.5])


def test_fully_masked_tokens_give_zero_loss_and_zero_gradient():
    x = _batch(seed=6, gap=5.0)  # every ratio far outside [0.9, 1.1]
    x.behaviour_logp = x.proximal_logp + 5.0
    s = LossSettings(off_policy="mis-token", is_low=0.9, is_high=1.1)
    loss_v, stats = policy_loss(s, x)
    (g,) = torch.autograd.grad(loss_v, x.logp)
    assert float(loss_v.detach()) == 0.0 and bool((g == 0).all())
    assert float(stats["is_masked_frac"]) == len(g)


def test_empty_micro_batch_is_zero_not_nan():
    e = torch.zeros(0)
    x = LossInputs(
        logp=e.clone().requires_grad_(),
        behaviour_logp=e,
        proximal_logp=e,
        advantages=e,
        token_weight=e,
        seq_index=torch.zeros(0, dtype=torch.int64),
        num_seqs=1,
        entropy=e,
        ref_logp=e,
    )
    for off in ("tis-seq", "mis-seq", "mis-seq-geo", "tis-token"):
        loss_v, stats = policy_loss(LossSettings(loss="gspo", off_policy=off, kl_coef=0.1, entropy_coef=0.1), x)
        assert float(loss_v.detach()) == 0.0 and all(math.isfinite(float(v)) or "_m" in k for k, v in stats.items())


def test_settings_validation():
    with pytest.raises(ValueError, match="loss='reinforce'"):
        LossSettings(loss="reinforce")
    with pytest.raises(ValueError, match="off-policy='x'"):
        LossSettings(off_policy="x")
