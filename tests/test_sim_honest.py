"""The simulator's honesty: a fitted (not true) router cost model, noisy step times, a published-statistics
length distribution, KV capacity from model size and GPU memory, >= 40 measured steps (the grid's
output contract: tests/test_grid.py)."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

from staleflow.coordinator.cost_model import load_cost_model
from staleflow.sim.config import SimConfig
from staleflow.sim.hardware import GPU, MODEL_SPECS, derive, kv_capacity
from staleflow.sim.lengths import LengthSampler
from staleflow.sim.simulator import build, router_cost_model, run

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import sim_config  # noqa: E402


def small(**kw) -> SimConfig:
    return sim_config(**kw)


def test_sim_router_sees_a_fitted_cost_model_not_the_truth():
    cfg = SimConfig()
    true = load_cost_model("qwen2.5-32b-tp2")
    fitted = router_cost_model(true, cfg, random.Random(0))
    assert fitted != true and fitted.name.endswith("-fitted")
    rel = [
        abs(fitted.step_time(n, kv) - true.step_time(n, kv)) / true.step_time(n, kv)
        for n in (1, 8, 32, 128)
        for kv in (0, 50_000, 200_000)
    ]
    assert 0 < max(rel) < 0.2  # close (10 % noise on 200 samples), never exact
    loop, backend, _ = build(cfg, "staleflow", 2)
    assert loop.coord.cost_model != backend.cost and backend.cost.kv_capacity == loop.coord.cost_model.kv_capacity
    assert router_cost_model(true, small(router_fit_samples=0), random.Random(0)) is true


def test_sim_kv_capacity_and_rates_come_from_model_size_and_gpu_memory():
    spec = MODEL_SPECS["qwen2.5-32b-tp2"]
    # (96 GB x 0.9 - 65.6 GB / 2 - 4 GB) / (64 layers x 2 x 4 heads per GPU x 128 x 2 bytes)
    assert kv_capacity(spec, GPU()) == int((96e9 * 0.9 - 65.6e9 / 2 - 4e9) / (64 * 2 * 4 * 128 * 2))
    # an H200 (141 GB) has (126.9 - 32.8 - 4) / (86.4 - 32.8 - 4) = 1.82x the KV room
    assert kv_capacity(spec, GPU(memory_gb=141)) / kv_capacity(spec, GPU()) == pytest.approx(90.1 / 49.6, rel=1e-3)
    with pytest.raises(ValueError, match="does not fit"):
        kv_capacity(MODEL_SPECS["qwen2.5-32b-tp2"], GPU(memory_gb=40))
    hw = derive(SimConfig(), load_cost_model("qwen2.5-32b-tp2"))
    assert hw.kv_capacity == kv_capacity(spec, GPU()) and 1700 < hw.prefill_tokens_per_s < 1900
    # the peers' broadcast moves weights into an instance at StaleFlow's pull rate (issue 49's fairness) ...
    assert hw.broadcast_s == pytest.approx(hw.pull_s) == pytest.approx(2.05) and hw.pull_s < hw.push_s
    # ... and at verl's checkpoint engine's 8 GB/s when asked (the default before 2026-12-07)
    assert derive(SimConfig(broadcast_gb_s=8.0), load_cost_model("qwen2.5-32b-tp2")).broadcast_s == pytest.approx(8.2)
    assert derive(SimConfig(kv_capacity=1000), load_cost_model("qwen2.5-32b-tp2")).kv_capacity == 1000
    with pytest.raises(ValueError, match="give --prefill-tokens-per-s"):
        derive(SimConfig(cost_model="cpu-smollm2"), load_cost_model("cpu-smollm2"))


def test_sim_long_cot_lengths_match_the_published_statistics():
    rng = random.Random(0)
    s = LengthSampler("long-cot", 4000.0, 0.8, 20000, rng)
    groups = []
    for _ in range(3000):
        s.new_prompt()
        groups.append([s() for _ in range(8)])
    xs = sorted(x for g in groups for x in g)
    assert 5000 < statistics.mean(xs) < 6000  # DeepScaleR ~5.5k
    assert 0.01 < sum(x == 20000 for x in xs) / len(xs) < 0.05  # AReaL: < 5 % truncated
    top = xs[int(0.9 * len(xs)) :]
    assert 0.25 < sum(top) / sum(xs) < 0.4  # a long tail
    # same-prompt responses are alike (Seer): within-group spread is smaller than the overall spread
    within = statistics.mean(statistics.pstdev(g) for g in groups)
    assert within < 0.8 * statistics.pstdev(xs)
    lognormal = LengthSampler("lognormal", 4000.0, 0.8, 20000, random.Random(0))
    assert abs(statistics.median(lognormal() for _ in range(20000)) - 4000) < 200


def test_sim_step_times_are_noisy_and_seeded():
    a, b, c = (run(small(seed=s), "staleflow", 1) for s in (0, 0, 1))
    assert a.step_times == b.step_times  # deterministic per seed
    quiet = run(small(step_noise=0.0, instance_spread=0.0, train_noise=0.0), "staleflow", 1)
    assert quiet.step_times != a.step_times and a.step_times != c.step_times
    loop, backend, _ = build(small(), "staleflow", 1)
    assert len({round(i.speed, 6) for i in backend.insts}) == len(backend.insts) > 1


@pytest.mark.parametrize("eta", [1, 2])
def test_sim_no_trained_group_beat_its_tail_floor(eta):
    """The premise of the grid's tail floor: a group tagged V starts after version V is published and
    its longest response takes at least that many tokens decoded alone on the fastest instance."""
    cfg = small(steps=10)
    loop, backend, _ = build(cfg, "staleflow", eta)
    loop.run()
    cost = load_cost_model(cfg.cost_model)
    fastest = min(i.speed for i in backend.insts)
    checked = 0
    for rec in loop.steps:
        for g in rec.groups:
            published = 0.0 if g.traj_version == 0 else backend.step_end[g.traj_version - 1]
            alone = cost.steps_time(1, g.prompt_len, max(g.n_tokens)) * fastest
            assert rec.t_start - published >= 0.95 * alone, (rec.version, g.traj_version, max(g.n_tokens))
            checked += 1
    assert checked == cfg.steps * cfg.staleness.batch_size


def test_sim_measures_at_least_40_steps_after_warm_up_by_default():
    cfg = SimConfig()
    assert cfg.steps - cfg.warmup_steps >= 40
