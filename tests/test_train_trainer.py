"""Trainer: split invariance (micro-batches, ranks), packing exactness, on-policy identities, learning.

The two-rank and lazy-init tests are in test_train_distributed.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import (  # noqa: E402
    assert_same,
    capture_grads,
    flat,
    lipschitz_adam,
    random_batch,
    sample_responses,
    tiny_model,
    train_group,
)

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.train.batch import build_micro_batch  # noqa: E402
from staleflow.train.trainer import PolicyHead, Trainer, lr_factor  # noqa: E402
from staleflow.trajectory import TrajectoryTokens  # noqa: E402


def test_packed_micro_batch_equals_each_sequence_alone():
    torch.manual_seed(0)
    head = PolicyHead(tiny_model(seed=1))
    samples = flat(random_batch(seed=2, groups=2, min_response=1))
    ids = list(range(len(samples)))
    zeros = [0.0] * len(samples)
    with torch.no_grad():
        packed, ent = head(build_micro_batch(samples, ids, zeros, zeros), 1.0, "chunked")
        alone = torch.cat([head(build_micro_batch(samples, [i], zeros, zeros), 1.0, "chunked")[0] for i in ids])
        naive, _ = head(build_micro_batch(samples, ids, zeros, zeros), 1.0, "naive")
    torch.testing.assert_close(packed, alone, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(packed, naive, atol=2e-6, rtol=1e-5)
    assert packed.shape[0] == sum(len(s.response_ids) for s in samples) and (ent > 0).all()


@pytest.mark.parametrize(
    "agg,off_policy,loss",
    [
        ("token-mean", "tis-token", "grpo"),
        ("seq-mean", "mis-seq", "gspo"),
        ("seq-mean-token-sum", "tis-seq", "grpo"),
        ("seq-mean-token-sum-norm", "mis-seq-geo", "grpo"),
    ],
)
def test_one_vs_many_micro_batches_give_the_same_step(agg, off_policy, loss):
    batch = random_batch(seed=3, groups=4)
    samples = flat(batch)
    results = []
    for budget in (4096, 14):
        cfg = TrainConfig(
            lr=1e-2,
            micro_batch_tokens=budget,
            loss_agg=agg,
            off_policy=off_policy,
            loss=loss,
            clip_high=0.28,
            entropy_coef=0.01,
            grad_clip=0.5,
        )
        t = Trainer(tiny_model(seed=4), cfg, max_response_tokens=8)
        lipschitz_adam(t)
        grads = capture_grads(t)
        m = t.step(*batch)
        results.append(
            (m, grads[0], t.full_state_dict(), len(t._plan(samples, list(range(len(samples))), [0.0] * len(samples))))
        )
    (m1, g1, w1, n1), (m4, g4, w4, n4) = results
    assert n1 == 1 and n4 >= 4
    assert m1["loss"] == pytest.approx(m4["loss"], rel=1e-5, abs=1e-7)
    assert m1["grad_norm"] == pytest.approx(m4["grad_norm"], rel=1e-5)
    assert_same(g1, g4)  # gradients: fp32-identical
    assert_same(w1, w4, atol=1e-6)


def test_loss_aggregation_reaches_the_micro_batches_with_empty_completions_counted():
    samples = flat(random_batch(seed=14, groups=3))  # some zero-length responses
    n_empty = sum(1 for s in samples if not s.response_ids)
    assert n_empty > 0
    with pytest.raises(ValueError, match="max_response_tokens=None.*--rollout.max-new-tokens"):
        Trainer(tiny_model(), TrainConfig(advantage="dr-grpo", loss_agg="auto"))
    t = Trainer(tiny_model(), TrainConfig(advantage="dr-grpo", loss_agg="auto"), max_response_tokens=8)
    assert t.loss_agg == "seq-mean-token-sum-norm"
    t._oversize = 0
    ids = list(range(len(samples)))
    weights = torch.cat([mb.token_weight for mb in t._plan(samples, ids, [0.0] * len(samples))])
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / (len(samples) * 8)))  # S counts the empty ones
    assert Trainer(tiny_model(), TrainConfig(loss="gspo", loss_agg="auto")).loss_agg == "seq-mean"


def test_decoupled_recomputed_proximal_equals_tis_token_with_one_update():
    batch = random_batch(seed=5, groups=3)
    grads = []
    for off in ("tis-token", "decoupled"):
        t = Trainer(tiny_model(seed=6), TrainConfig(lr=1e-3, micro_batch_tokens=30, off_policy=off))
        seen = capture_grads(t)
        t.step(*batch)
        grads.append(seen[0])
    assert_same(*grads, atol=1e-7)


def test_activation_checkpointing_gives_the_same_gradients():
    batch = random_batch(seed=12, groups=2, min_response=1)
    grads = []
    for ac in ("off", "on"):
        t = Trainer(tiny_model(seed=13), TrainConfig(micro_batch_tokens=30, activation_checkpointing=ac))
        assert t.model.gradient_checkpointing == (ac == "on")
        seen = capture_grads(t)
        t.step(*batch)
        grads.append(seen[0])
    assert_same(*grads, atol=1e-7)


def test_mini_batches_make_several_updates_against_the_proximal_policy():
    batch = random_batch(seed=7, groups=4, min_response=2)
    t = Trainer(
        tiny_model(seed=8),
        TrainConfig(
            lr=5e-2, micro_batch_tokens=40, mini_batches=2, off_policy="decoupled", clip_low=0.01, clip_high=0.01
        ),
    )
    seen = capture_grads(t)
    m = t.step(*batch)
    assert len(seen) == 2 and t.optimizer_steps == 2 and t.version == 1
    assert m["ppo_clipped_frac_mean"] > 0  # the second update's ratio moved away from the proximal policy


def test_kl_to_reference_is_zero_before_the_first_update():
    batch = random_batch(seed=9, groups=2, min_response=1)
    t = Trainer(tiny_model(seed=1), TrainConfig(lr=1e-2, kl_coef=0.1, kl_estimator="k3"))
    ref = dict(t.ref_policy.lm.named_parameters())
    for name, p in t.model.named_parameters():  # its own storage, the compute dtype, frozen
        assert ref[name].data_ptr() != p.data_ptr() and ref[name].dtype == torch.float32
        assert torch.equal(ref[name], p) and not ref[name].requires_grad
    m1 = t.step(*batch)
    m2 = t.step(*batch)
    assert m1["ref_kl_k3_mean"] == pytest.approx(0.0, abs=1e-9) and m2["ref_kl_k3_mean"] > 1e-7


def test_activation_checkpointing_auto_is_on_for_cuda_only_and_old_booleans_still_load():
    from staleflow.train.parallelize import activation_checkpointing_on, compute_dtype

    assert TrainConfig().activation_checkpointing == "auto"
    assert activation_checkpointing_on("auto", "cuda") and not activation_checkpointing_on("auto", "cpu")
    assert activation_checkpointing_on(True, "cpu") and not activation_checkpointing_on(False, "cuda")  # old configs
    with pytest.raises(ValueError, match="train.activation-checkpointing"):
        activation_checkpointing_on("sometimes", "cpu")
    assert compute_dtype("cuda") == torch.bfloat16 and compute_dtype("cpu") == torch.float32
    assert Trainer(tiny_model(seed=1), TrainConfig()).model.gradient_checkpointing is False  # auto on CPU


def test_lm_head_reaches_the_logprob_op_in_the_autocast_dtype_on_cuda(monkeypatch):
    """A single CUDA rank keeps fp32 master weights under bf16 autocast: the LM head and its rows
    must reach the log-prob kernel in bf16 (tensor cores), not fp32. No GPU here: CUDA tensors are
    stood in for by objects that report a CUDA device and record the cast."""
    from types import SimpleNamespace

    from staleflow.train.trainer import head_operands

    def fake(name):
        return SimpleNamespace(device=torch.device("cuda"), to=lambda dt: (name, dt))

    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: device_type == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.bfloat16)
    assert head_operands(fake("rows"), fake("head")) == (("rows", torch.bfloat16), ("head", torch.bfloat16))
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: False)
    rows, head = fake("rows"), fake("head")
    assert head_operands(rows, head) == (rows, head)  # no autocast (FSDP2's bf16 params): untouched


def test_dynamic_sampling_and_all_filtered_step():
    groups, payloads = random_batch(seed=10, groups=3, min_response=1)
    groups[0] = msgspec.structs.replace(groups[0], rewards=[1.0] * len(groups[0].rewards))  # no signal
    t = Trainer(tiny_model(seed=2), TrainConfig(lr=1e-2, dynamic_sampling=True))
    m = t.step(groups, payloads)
    assert m["groups_dropped"] == 1 and m["samples_trained"] == 12 - 4 and m["samples"] == 12
    empty = [TrajectoryTokens([1]) for _ in range(3)]  # only zero-length responses
    m = t.step([train_group(7, 0, [0.0, 1.0, 2.0], empty)], [empty])
    assert m["samples_trained"] == 3 and m["response_tokens"] == 0 and t.optimizer_steps == 1
    before = t.full_state_dict()
    m = t.step(groups[:1], payloads[:1])  # nothing left to learn from: no update, the version still advances
    assert m["samples_trained"] == 0 and t.version == 3 and t.optimizer_steps == 1
    assert_same(before, t.full_state_dict(), atol=0)


def test_bad_payloads_and_config_are_rejected_with_clear_errors():
    t = Trainer(tiny_model(), TrainConfig())
    ok = TrajectoryTokens([1, 2], [3, 4], [-0.1, -0.2], [0, 0])
    bad = TrajectoryTokens([1, 2], [3, 4], [-0.1], [0, 0])
    with pytest.raises(ValueError, match=r"^group 5 member 1 \(trajectory 501\): 1 behaviour_logprobs for 2 response"):
        t.step([train_group(5, 0, [1.0, 0.0], [ok, bad])], [[ok, bad]])
    with pytest.raises(ValueError, match="^group 0 member 0 .*prompt_ids is empty"):
        t.step([train_group(0, 0, [1.0], [ok])], [[TrajectoryTokens([], [3], [-0.1], [0])]])
    with pytest.raises(ValueError, match=r"^group 2 member 0 \(trajectory 200\): reward=nan is not a finite number"):
        t.step([train_group(2, 0, [float("nan")], [ok])], [[ok]])
    with pytest.raises(ValueError, match="^group 4: 1 payloads and 2 traj_ids for 2 rewards"):
        t.step([train_group(4, 0, [1.0, 0.0], [ok, ok])], [[ok]])
    with pytest.raises(ValueError, match="^1 payload lists for 2 groups"):
        t.step([train_group(0, 0, [1.0], [ok]), train_group(1, 0, [1.0], [ok])], [[ok]])
    assert t.version == 0 and t.optimizer_steps == 0  # a rejected step changes nothing
    with pytest.raises(ValueError, match="advantage='gae'"):
        Trainer(tiny_model(), TrainConfig(advantage="gae"))
    with pytest.raises(ValueError, match="total_steps"):
        Trainer(tiny_model(), TrainConfig(schedule="cosine"))


def test_a_meta_model_filled_from_its_weights_equals_the_loaded_one(tmp_path):
    from staleflow.model import lazy_model, save_hf

    save_hf(tiny_model(seed=5, tied=False), tmp_path)
    model, weights = lazy_model(str(tmp_path))
    lazy = Trainer(model, TrainConfig(), weights=weights())
    eager = Trainer(tiny_model(seed=5, tied=False), TrainConfig())
    assert_same(lazy.full_state_dict(), eager.full_state_dict(), atol=0)
    batch = random_batch(seed=3)
    assert lazy.step(*batch)["loss"] == eager.step(*batch)["loss"]

    with pytest.raises(ValueError, match="meta device needs its weights"):
        Trainer(lazy_model(str(tmp_path))[0], TrainConfig())
    model, weights = lazy_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"parameters were never given, e.g. \['lm_head.weight'\]"):
        Trainer(model, TrainConfig(), weights=((n, t) for n, t in weights() if n != "lm_head.weight"))
    model, _ = lazy_model(str(tmp_path))
    with pytest.raises(ValueError, match="'extra.weight' is not a parameter"):
        Trainer(model, TrainConfig(), weights=iter([("extra.weight", torch.zeros(1))]))
    model, _ = lazy_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(1, 32\), the parameter \(\d+, 32\)"):
        Trainer(model, TrainConfig(), weights=iter([("lm_head.weight", torch.zeros(1, 32))]))  # would broadcast
    model, weights = lazy_model(str(tmp_path))
    twice = list(weights())
    with pytest.raises(ValueError, match="given twice"):
        Trainer(model, TrainConfig(), weights=iter(twice[:1] + twice))
    with pytest.raises(ValueError, match="already loaded"):
        Trainer(tiny_model(seed=5), TrainConfig(), weights=iter(twice))


def test_lr_schedule():
    assert [lr_factor(s, 2, "constant", None) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, 1, "cosine", 5) for s in range(6)]
    assert cos[0] == 1.0 and cos[1] == 1.0 and cos[3] == pytest.approx(0.5) and cos[5] == pytest.approx(0.0)


def test_named_shards_unsharded_are_the_full_parameters():
    t = Trainer(tiny_model(seed=3), TrainConfig())
    full = t.full_state_dict()
    shards = list(t.named_shards())
    assert {s.name for s in shards} == set(full)
    for s in shards:
        assert s.row_offset == 0 and s.global_shape == tuple(full[s.name].shape)
        torch.testing.assert_close(s.local, full[s.name], atol=0, rtol=0)


def _target_reward(resp: list[int], target: int) -> float:
    return sum(t == target for t in resp) / len(resp)


def test_grpo_learns_a_toy_reward():
    """GRPO on-policy: reward = fraction of response tokens equal to 5 (chance: 1/16); 12 steps must lift it."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = tiny_model(seed=11, vocab=16)
    t = Trainer(model, TrainConfig(lr=5e-3, micro_batch_tokens=512, advantage="grpo", off_policy="tis-token"))
    prompts = [[1, 2], [3], [4, 7, 9], [6]]
    history = []
    for step in range(12):
        group_prompts = [p for p in prompts for _ in range(6)]
        resp, logps = sample_responses(model, group_prompts, 4, gen)
        payloads = [TrajectoryTokens(p, r, lp, [t.version] * len(r)) for p, r, lp in zip(group_prompts, resp, logps)]
        per_group = [payloads[g * 6 : (g + 1) * 6] for g in range(len(prompts))]
        groups = [
            train_group(g, t.version, [_target_reward(x.response_ids, 5) for x in ps], ps)
            for g, ps in enumerate(per_group)
        ]
        m = t.step(groups, per_group)
        history.append(m["reward_mean"])
        if step == 0:  # on-policy: behaviour == proximal up to sampler/trainer float noise
            assert m["behaviour_gap_abs_mean"] < 1e-5
    first, last = sum(history[:2]) / 2, sum(history[-3:]) / 3
    assert first < 0.15 and last > first + 0.4, history


# ---- two trainer ranks (real torchrun + gloo) -------------------------------------------------------
