"""Trainer: split invariance (micro-batches, ranks), packing exactness, on-policy identities, learning.

The two-rank test launches this file itself under `torchrun --nproc_per_node=2` (gloo, CPU):
see `_worker` at the bottom.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import random_samples, sample_responses, tiny_model  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.train.batch import build_micro_batch  # noqa: E402
from staleflow.train.trainer import PolicyHead, Trainer, lr_factor  # noqa: E402
from staleflow.trajectory import TrajectorySample


def _capture_grads(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Record the (full) gradients each optimizer update sees."""
    seen: list[dict[str, torch.Tensor]] = []

    def hook(optimizer, args, kwargs):
        g = {}
        for n, p in trainer.policy.named_parameters():
            grad = p.grad
            if grad is not None and hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            g[n] = None if grad is None else grad.detach().clone()
        seen.append(g)

    trainer.optimizer.register_step_pre_hook(hook)
    return seen


def _lipschitz_adam(trainer: Trainer) -> None:
    """AdamW's g / (sqrt(v) + eps) turns fp32 reassociation noise on near-zero gradients into
    O(lr) weight differences; a large eps makes the update Lipschitz in g, so weights can be
    compared after a step with fp32 tolerances (gradients are compared directly as well)."""
    trainer.optimizer.param_groups[0]["eps"] = 1e-3


def _assert_same(a: dict, b: dict, atol=2e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def test_packed_micro_batch_equals_each_sequence_alone():
    torch.manual_seed(0)
    head = PolicyHead(tiny_model(seed=1))
    samples = random_samples(seed=2, groups=2, min_response=1)
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
        ("seq-mean-token-sum", "tis-seq", "dapo"),
        ("seq-mean-token-sum-norm", "mis-seq-geo", "grpo"),
    ],
)
def test_one_vs_many_micro_batches_give_the_same_step(agg, off_policy, loss):
    samples = random_samples(seed=3, groups=4)
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
        _lipschitz_adam(t)
        grads = _capture_grads(t)
        m = t.step(samples)
        results.append(
            (m, grads[0], t.full_state_dict(), len(t._plan(samples, list(range(len(samples))), [0.0] * len(samples))))
        )
    (m1, g1, w1, n1), (m4, g4, w4, n4) = results
    assert n1 == 1 and n4 >= 4
    assert m1["loss"] == pytest.approx(m4["loss"], rel=1e-5, abs=1e-7)
    assert m1["grad_norm"] == pytest.approx(m4["grad_norm"], rel=1e-5)
    _assert_same(g1, g4)  # gradients: fp32-identical
    _assert_same(w1, w4, atol=1e-6)


def test_loss_aggregation_reaches_the_micro_batches_with_empty_completions_counted():
    samples = random_samples(seed=14, groups=3)  # some zero-length responses
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
    samples = random_samples(seed=5, groups=3)
    grads = []
    for off in ("tis-token", "decoupled"):
        t = Trainer(tiny_model(seed=6), TrainConfig(lr=1e-3, micro_batch_tokens=30, off_policy=off))
        seen = _capture_grads(t)
        t.step(samples)
        grads.append(seen[0])
    _assert_same(*grads, atol=1e-7)


def test_activation_checkpointing_gives_the_same_gradients():
    samples = random_samples(seed=12, groups=2, min_response=1)
    grads = []
    for ac in ("off", "on"):
        t = Trainer(tiny_model(seed=13), TrainConfig(micro_batch_tokens=30, activation_checkpointing=ac))
        assert t.model.gradient_checkpointing == (ac == "on")
        seen = _capture_grads(t)
        t.step(samples)
        grads.append(seen[0])
    _assert_same(*grads, atol=1e-7)


def test_mini_batches_make_several_updates_against_the_proximal_policy():
    samples = random_samples(seed=7, groups=4, min_response=2)
    t = Trainer(
        tiny_model(seed=8),
        TrainConfig(
            lr=5e-2, micro_batch_tokens=40, mini_batches=2, off_policy="decoupled", clip_low=0.01, clip_high=0.01
        ),
    )
    seen = _capture_grads(t)
    m = t.step(samples)
    assert len(seen) == 2 and t.optimizer_steps == 2 and t.version == 1
    assert m["ppo_clipped_frac_mean"] > 0  # the second update's ratio moved away from the proximal policy


def test_kl_to_reference_is_zero_before_the_first_update():
    samples = random_samples(seed=9, groups=2, min_response=1)
    t = Trainer(tiny_model(seed=1), TrainConfig(lr=1e-2, kl_coef=0.1, kl_estimator="k3"))
    ref = dict(t.ref_policy.lm.named_parameters())
    for name, p in t.model.named_parameters():  # its own storage, the compute dtype, frozen
        assert ref[name].data_ptr() != p.data_ptr() and ref[name].dtype == torch.float32
        assert torch.equal(ref[name], p) and not ref[name].requires_grad
    m1 = t.step(samples)
    m2 = t.step(samples)
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
    samples = random_samples(seed=10, groups=3, min_response=1)
    for s in samples:
        if s.group_id == 0:
            s.reward = 1.0
    t = Trainer(tiny_model(seed=2), TrainConfig(lr=1e-2, dynamic_sampling=True))
    m = t.step(samples)
    assert m["groups_dropped"] == 1 and m["samples_trained"] == len(samples) - 4
    empty = [TrajectorySample([1], [], [], [], float(i), 7, 0) for i in range(3)]  # only zero-length responses
    m = t.step(empty)
    assert m["samples_trained"] == 3 and m["response_tokens"] == 0 and t.optimizer_steps == 1
    flat = [s for s in samples if s.group_id == 0]
    before = t.full_state_dict()
    m = t.step(flat)  # nothing left to learn from: no update, the version still advances
    assert m["samples_trained"] == 0 and t.version == 3 and t.optimizer_steps == 1
    _assert_same(before, t.full_state_dict(), atol=0)


def test_bad_samples_and_config_are_rejected_with_clear_errors():
    t = Trainer(tiny_model(), TrainConfig())
    bad = TrajectorySample([1, 2], [3, 4], [-0.1], [0, 0], 1.0, 0, 0)
    with pytest.raises(ValueError, match="sample 0: 1 behaviour_logprobs for 2 response tokens"):
        t.step([bad])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        t.step([TrajectorySample([], [3], [-0.1], [0], 1.0, 0, 0)])
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
    _assert_same(lazy.full_state_dict(), eager.full_state_dict(), atol=0)
    samples = random_samples(seed=3)
    assert lazy.step(samples)["loss"] == eager.step(samples)["loss"]

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
        samples = [
            TrajectorySample(p, r, lp, [t.version] * len(r), _target_reward(r, 5), gi // 6, t.version)
            for gi, (p, r, lp) in enumerate(zip(group_prompts, resp, logps))
        ]
        m = t.step(samples)
        history.append(m["reward_mean"])
        if step == 0:  # on-policy: behaviour == proximal up to sampler/trainer float noise
            assert m["behaviour_gap_abs_mean"] < 1e-5
    first, last = sum(history[:2]) / 2, sum(history[-3:]) / 3
    assert first < 0.15 and last > first + 0.4, history


# ---- two trainer ranks (real torchrun + gloo) -------------------------------------------------------

DIST_CFG = dict(lr=1e-2, micro_batch_tokens=20, loss_agg="seq-mean", off_policy="tis-token", grad_clip=0.3)


def _dist_samples():
    return random_samples(seed=21, groups=5), random_samples(seed=22, groups=5)


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path):
    from staleflow.model import save_hf

    for tied in (True, False):  # the folders the lazy, shard-wise load reads (Trainer(..., weights=...))
        save_hf(tiny_model(seed=20, tied=tied, vocab=LAZY_VOCAB), tmp_path / f"hf-tied{int(tied)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALEFLOW_TEST_OUT": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    # the same two steps on one unsharded rank
    a, b = _dist_samples()
    t = Trainer(tiny_model(seed=20), TrainConfig(**DIST_CFG))
    _lipschitz_adam(t)
    grads = _capture_grads(t)
    m1, m2 = t.step(a), t.step(b)
    for k in ("loss", "grad_norm", "is_weight_mean", "entropy_mean"):
        assert got["metrics"][0][k] == pytest.approx(m1[k], rel=1e-5), k
        assert got["metrics"][1][k] == pytest.approx(m2[k], rel=1e-5), k
    strip = {k.removeprefix("lm."): v for k, v in grads[1].items()}
    _assert_same({k.removeprefix("lm."): v for k, v in got["grads"].items()}, strip)
    full = t.full_state_dict()
    _assert_same(got["full"], full, atol=1e-5)
    _assert_same(got["rank0_only"], got["full"], atol=0)
    # gradients are reduce-scattered after EVERY micro-batch: from the second micro-batch of a
    # step on, the parameters already hold sharded gradients (no unsharded ones are kept)
    assert got["reduced"].count(False) == 2 and len(got["reduced"]) > 2 and all(got["reduced"][1:2])
    assert got["ref_ok"] and got["kl0"] == pytest.approx(0.0, abs=1e-9)
    # a meta-device model filled shard-wise from its folder equals the full model sharded, rank by rank
    assert got["lazy"] == {True: True, False: True} and got["lazy_other_rank"] == {True: True, False: True}

    # each rank's own shards tile the full tensors exactly
    shards = [torch.load(tmp_path / f"shards{r}.pt", weights_only=False) for r in (0, 1)]
    for name, ref in got["full"].items():
        pieces = sorted((s for r in shards for s in r if s.name == name), key=lambda s: s.row_offset)
        assert [tuple(s.global_shape) for s in pieces] == [tuple(ref.shape)] * 2
        torch.testing.assert_close(torch.cat([s.local for s in pieces]), ref, atol=0, rtol=0)

    # the 2-rank sharded checkpoint reloads on 1 rank and continues like the 1-rank run
    from staleflow.train.checkpoint import latest_checkpoint, load_checkpoint

    r = Trainer(tiny_model(seed=99), TrainConfig(**DIST_CFG))
    _lipschitz_adam(r)
    load_checkpoint(r, latest_checkpoint(tmp_path / "ckpt"))
    assert r.version == 2
    _assert_same(r.full_state_dict(), got["full"], atol=0)
    c = random_samples(seed=23, groups=5)
    assert r.step(c)["loss"] == pytest.approx(t.step(c)["loss"], rel=1e-5)
    _assert_same(r.full_state_dict(), t.full_state_dict(), atol=1e-5)


LAZY_VOCAB = 37  # odd: the embedding's rows split 19 / 18, so FSDP2 pads one rank's shard


def _lazy_equals_eager(folder: Path, tied: bool) -> bool:
    """Each rank's shards after the lazy load equal those of the full model sharded (no rank ever
    held the full model in the lazy case), padding included, and so does a step (with KL) after."""
    import torch.distributed as dist

    from staleflow.model import lazy_model

    cfg = TrainConfig(**DIST_CFG, kl_coef=0.1)
    model, weights = lazy_model(str(folder))
    assert all(p.is_meta for p in model.parameters())
    lazy = Trainer(model, cfg, process_group=dist.group.WORLD, weights=weights())
    eager = Trainer(tiny_model(seed=20, tied=tied, vocab=LAZY_VOCAB), cfg, process_group=dist.group.WORLD)

    def same() -> bool:
        pairs = list(zip(lazy.model.named_parameters(), eager.model.named_parameters(), strict=True))
        return all(
            n == m
            and hasattr(p, "to_local")
            and p.placements == q.placements
            and torch.equal(p.to_local(), q.to_local())
            for (n, p), (m, q) in pairs
        )

    def padded(trainer) -> list[torch.Tensor]:  # FSDP2's padded shard storage: what its all-gather reads
        groups = [
            m._get_fsdp_state()._fsdp_param_group for m in trainer.policy.modules() if hasattr(m, "_get_fsdp_state")
        ]
        return [fp._sharded_param_data for g in groups if g is not None for fp in g.fsdp_params]

    pairs = list(zip(padded(lazy), padded(eager), strict=True))
    ok = same() and bool(pairs) and all(torch.equal(a, b) for a, b in pairs)
    samples = random_samples(seed=31, groups=4, vocab=LAZY_VOCAB)
    ml, me = lazy.step(samples), eager.step(samples)
    return ok and ml["loss"] == me["loss"] and ml["ref_kl_k3_mean"] == me["ref_kl_k3_mean"] and same()


def _worker():
    import torch.distributed as dist

    from staleflow.train.checkpoint import save_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(os.environ["STALEFLOW_TEST_OUT"])
    lazy = {tied: _lazy_equals_eager(out / f"hf-tied{int(tied)}", tied) for tied in (True, False)}
    lazy_all = [None, None]
    dist.all_gather_object(lazy_all, lazy)
    a, b = _dist_samples()
    t = Trainer(tiny_model(seed=20), TrainConfig(**DIST_CFG), process_group=dist.group.WORLD)
    _lipschitz_adam(t)
    grads = _capture_grads(t)
    reduced = []  # before each micro-batch's forward: do the params hold sharded (reduced) grads yet?
    forward = t._forward

    def spy(policy, mb):
        if policy is t.policy and torch.is_grad_enabled():
            reduced.append(all(p.grad is not None and hasattr(p.grad, "to_local") for p in t.policy.parameters()))
        return forward(policy, mb)

    t._forward = spy
    metrics = [t.step(a), t.step(b)]
    torch.save(list(t.named_shards()), out / f"shards{rank}.pt")
    full = t.full_state_dict()
    on_rank = t.full_state_dict(rank0_only=True)
    save_checkpoint(t, out / "ckpt", extra={"from": "two ranks"})
    # the KL reference: sharded like the policy, its own storage, equal to the starting weights
    k = Trainer(tiny_model(seed=20), TrainConfig(**DIST_CFG, kl_coef=0.1), process_group=dist.group.WORLD)
    ref_ok = all(
        hasattr(q, "to_local")
        and torch.equal(q.to_local(), p.to_local())
        and q.to_local().data_ptr() != p.to_local().data_ptr()
        for p, q in zip(k.model.parameters(), k.ref_policy.lm.parameters())
    )
    kl0 = k.step(a)["ref_kl_k3_mean"]
    if rank != 0:
        assert on_rank == {}, "rank0_only: another rank kept gathered tensors"
    if rank == 0:
        torch.save(
            {
                "metrics": metrics,
                "grads": grads[1],
                "full": full,
                "rank0_only": on_rank,
                "reduced": reduced,
                "ref_ok": ref_ok,
                "kl0": kl0,
                "lazy": lazy,
                "lazy_other_rank": lazy_all[1],
            },
            out / "rank0.pt",
        )
    dist.barrier()
    dist.destroy_process_group()
    # no interpreter shutdown: a gloo worker thread may still be freeing the last collective's
    # Python-owned tensors, and one that needs the GIL during finalization aborts the process
    # (the runtime's ranks leave the same way, staleflow.cli._leave)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker()
