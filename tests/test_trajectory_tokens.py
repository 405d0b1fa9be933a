"""The token payload (TrajectoryTokens): validation, environment tokens through the engine, and the
loss mask in the trainer, checked against an independent recomputation that drops the masked tokens.

The ring round trip of a masked payload is in test_servers_ring.py."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import VOCAB, capture_grads, tiny_model, train_group  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.model import PackedAttention, cu_seqlens_from_lengths, packed_positions  # noqa: E402
from staleflow.rollout.builtin_engine import BuiltinEngine  # noqa: E402
from staleflow.rollout.engine import EngineError, Request, SamplingParams  # noqa: E402
from staleflow.train.batch import build_micro_batch, step_payloads  # noqa: E402
from staleflow.train.trainer import Trainer  # noqa: E402
from staleflow.trajectory import ENV_LOGPROB, ENV_VERSION, TrajectoryTokens, model_versions  # noqa: E402


def _multi_turn(rng: random.Random, n_turns: int = 3) -> TrajectoryTokens:
    """A prompt, then turns of model tokens each followed by an observation (environment tokens)."""
    t = TrajectoryTokens([rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))])
    for _ in range(n_turns):
        for _ in range(rng.randint(1, 4)):
            t.append(rng.randrange(VOCAB), -rng.uniform(2.5, 4.5), 3 - rng.randint(0, 1))
        t.append_observation([rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))])
    return t


# ---- the payload ------------------------------------------------------------------------------
def test_payload_validation_names_the_field():
    ok = TrajectoryTokens([1], [5, 6], [-0.5, ENV_LOGPROB], [2, ENV_VERSION], [1, 0])
    ok.validate()
    assert ok.num_trained == 1 and model_versions(ok) == [2] and ok.mask_values() == [1, 0]
    single = TrajectoryTokens([1], [5, 6], [-0.5, -0.1], [2, 3])
    assert single.num_trained == 2 and single.mask_values() == [1, 1]  # None means all ones
    bad = [
        (TrajectoryTokens([], [5], [-0.5], [2]), "prompt_ids is empty"),
        (TrajectoryTokens([1], [5, 6], [-0.5], [2, 2]), "1 behaviour_logprobs for 2 response tokens"),
        (TrajectoryTokens([1], [5], [-0.5], [2, 2]), "2 versions for 1 response tokens"),
        (TrajectoryTokens([1], [5], [-0.5], [2], [1, 0]), "2 loss_mask entries for 1"),
        (TrajectoryTokens([1], [5], [-0.5], [2], [2]), r"loss_mask\[0\]=2 is invalid"),
        (TrajectoryTokens([1], [5], [0.5], [2]), "behaviour log-prob 0.5 is invalid"),
        (TrajectoryTokens([1], [5], [-0.5], [-1]), r"versions\[0\]=-1 is invalid for a model token"),
        (TrajectoryTokens([1], [5], [-0.5], [ENV_VERSION], [0]), "environment token 0"),
        (TrajectoryTokens([1], [5], [ENV_LOGPROB], [3], [0]), "store ENV_LOGPROB"),
    ]
    for t, match in bad:
        with pytest.raises(ValueError, match=match):
            t.validate("trajectory 7")
    with pytest.raises(ValueError, match=r"^group 4 member 0 \(trajectory 400\): 1 behaviour_logprobs"):
        step_payloads([train_group(4, 0, [1.0], [bad[1][0]])], [[bad[1][0]]])  # the trainer names group and member
    tensors = TrajectoryTokens(
        torch.tensor([1]), torch.tensor([5, 6]), torch.tensor([-0.5, 0.0]), torch.tensor([2, -1])
    )
    with pytest.raises(ValueError, match=r"versions\[1\]=-1"):  # tensor fields validate alike
        tensors.validate()


def test_engine_resumes_a_payload_with_environment_tokens():
    """A multi-turn payload (an observation after the model's tokens) is re-prefilled whole; the new
    tokens are the model's (mask 1) and the environment tokens keep their sentinels."""
    eng = BuiltinEngine(tiny_model(seed=3), max_kv_tokens=256, block_size=4, max_model_len=64)
    (first,) = eng.generate([Request("a", [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))])
    t = first.tokens
    assert t.loss_mask is None and t.versions == [0, 0, 0]
    t.append_observation([7, 8])
    (out,) = eng.generate([Request("a", t, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))])
    o = out.tokens
    o.validate()
    assert o.prompt_ids == [1, 2, 3] and o.response_ids[:5] == t.response_ids and len(o.response_ids) == 8
    assert o.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1] and o.versions[3:5] == [ENV_VERSION] * 2
    assert o.behaviour_logprobs[:5] == t.behaviour_logprobs
    (again,) = BuiltinEngine(tiny_model(seed=3), max_kv_tokens=256, block_size=4, max_model_len=64).generate(
        [
            Request(
                "b",
                [1, 2, 3, *first.tokens.response_ids, 7, 8],
                SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True),
            )
        ]
    )
    assert o.response_ids[5:] == again.tokens.response_ids  # the same context, whoever wrote it
    broken = TrajectoryTokens([1, 2], [5, 6], [-0.5, -0.2], [0, 0], [1, 0])  # an env token with a log-prob
    with pytest.raises(EngineError, match="environment token 1"):
        eng.add(Request("c", broken))


# ---- the trainer ------------------------------------------------------------------------------
def _reference_loss(model, payloads, adv, cfg: TrainConfig, agg: str) -> torch.Tensor:
    """PPO-clip with tis-token weights over the model's tokens only, each sequence run alone (fp32):
    environment tokens are context and nothing else."""
    per_seq = []
    for t, a in zip(payloads, adv):
        ids = torch.tensor(list(t.prompt_ids) + list(t.response_ids))
        cu = cu_seqlens_from_lengths([len(ids)])
        hidden = model(ids, packed_positions(cu), PackedAttention(cu))  # [L, H]
        logp_all = torch.log_softmax(model.compute_logits(hidden).float(), -1)  # [L, V]
        p = len(t.prompt_ids)
        keep = [j for j, m in enumerate(t.mask_values()) if m == 1]
        logp = logp_all[[p - 1 + j for j in keep], [t.response_ids[j] for j in keep]]  # [K]
        mu = torch.tensor([t.behaviour_logprobs[j] for j in keep])
        w = torch.exp(logp.detach() - mu).clamp(max=cfg.is_cap)
        r = torch.exp(logp - logp.detach())
        pg = torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)) * w
        per_seq.append(pg)
    if agg == "token-mean":
        return torch.cat(per_seq).sum() / sum(len(x) for x in per_seq)
    return sum(x.sum() / max(len(x), 1) for x in per_seq) / len(per_seq)  # seq-mean over trained tokens


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_masked_tokens_leave_the_loss_and_the_ratios(agg):
    rng = random.Random(0)
    samples = [(_multi_turn(rng), float(rng.randint(0, 3))) for _ in range(8)]  # two groups of four
    payloads = [[x for x, _ in samples[:4]], [x for x, _ in samples[4:]]]
    groups = [train_group(g, 2, [r for _, r in samples[4 * g : 4 * g + 4]], payloads[g]) for g in range(2)]
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=40, loss_agg=agg, off_policy="tis-token", grad_clip=0.0)
    t = Trainer(tiny_model(seed=4), cfg)
    ref_model = tiny_model(seed=4)
    _, adv, _ = t.prepare(groups, payloads)
    grads = capture_grads(t)
    metrics = t.step(groups, payloads)
    want = _reference_loss(ref_model, [x for x, _ in samples], adv, cfg, agg)
    want.backward()
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert metrics["response_tokens"] == sum(x.num_trained for x, _ in samples)
    got = {k.removeprefix("lm."): g for k, g in grads[0].items()}  # the trainer's PolicyHead wraps the model
    ref = dict(ref_model.named_parameters())
    assert got.keys() == ref.keys()
    for name, p in ref.items():
        torch.testing.assert_close(got[name], p.grad, atol=2e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_an_all_ones_mask_packs_exactly_like_none():
    rng = random.Random(1)

    def sample(mask: bool) -> TrajectoryTokens:
        n = rng.randint(1, 6)
        t = TrajectoryTokens(
            [3, 4], [rng.randrange(VOCAB) for _ in range(n)], [-rng.uniform(1, 2) for _ in range(n)], [2] * n
        )
        t.loss_mask = [1] * n if mask else None
        return t

    rng.seed(1)
    plain = [sample(False) for _ in range(5)]
    rng.seed(1)
    ones = [sample(True) for _ in range(5)]
    ids, adv, w = list(range(5)), [0.5, -0.5, 1.0, 0.0, 2.0], [0.1] * 5
    a, b = build_micro_batch(plain, ids, adv, w), build_micro_batch(ones, ids, adv, w)
    assert a.rows.numel() == sum(len(s.response_ids) for s in plain)
    for k, v in vars(a).items():
        assert torch.equal(v, getattr(b, k)) if isinstance(v, torch.Tensor) else v == getattr(b, k), k
