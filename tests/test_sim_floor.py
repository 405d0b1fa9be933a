"""The physical floor of a step (sim/floor.py): never above any mode's measured step, each term as derived,
and a KV-bound setting that preempts (``pytest -k "physical_floor or load_axis or guarantee or ablation"``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from staleflow.config import StalenessConfig
from staleflow.coordinator.cost_model import CostModel
from staleflow.sim.floor import fleet_seconds, physical_floor
from staleflow.sim.simulator import run

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import sim_config, tiny_sim  # noqa: E402

RUNS = [
    ("verl-sync", 0, {}),
    ("verl-one-step-off", 1, {}),
    ("verl-fully-async", 1, {}),
    ("verl-fully-async", 1, {"staleness_threshold": 0.0, "trigger_sync_steps": 2}),
    ("areal", 2, {}),
    ("staleflow", 1, {}),
    ("staleflow", 3, {}),
]
CONFIGS = {
    "tail-bound": lambda: tiny_sim(steps=10),
    "work-bound": lambda: tiny_sim(
        staleness=StalenessConfig(batch_size=16, group_size=4), total_gpus=8, rollout_gpus=2, max_running=8, steps=10
    ),
    "kv-bound": lambda: sim_config(
        staleness=StalenessConfig(batch_size=8, group_size=4),
        kv_capacity=1200,
        response_median=300.0,
        max_response=800,
        router_fit_samples=30,
        steps=10,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_physical_floor_is_never_above_a_runs_measured_step_for_any_mode(name):
    cfg = CONFIGS[name]()
    binds = set()
    for mode, eta, peer in RUNS:
        r = run(cfg, mode, eta, peer=peer)
        assert r.violations == [] and r.floor is not None
        f = r.floor
        assert 0 < f.floor <= r.step_s, (mode, eta, peer, f.row(), r.step_s)
        assert f.floor == max(f.train, f.work, f.tail) and 0 <= f.util <= 1
        binds.add(f.binds)
    # the sweep reaches the regime it is named for (the test would not pass vacuously on one term)
    assert {"tail-bound": "tail", "work-bound": "work", "kv-bound": "train"}[name] in binds


def test_physical_floor_terms_as_derived():
    cost = CostModel(k1=1e-4, k2=0.01, k3=0.001, b3=0.0, k4=0.0, kv_capacity=100)
    lengths = [(10, 20), (10, 40)]
    n_tok, ctx = 60, 20 * 10 + 20 * 19 / 2 + 40 * 10 + 40 * 39 / 2
    steps = max(n_tok / 4, ctx / 100)  # KV capacity binds: ctx / 100 > 15
    assert steps == ctx / 100
    want = 1e-4 * ctx + max(0.01 * steps, 0.001 * n_tok) + 20 / 1000
    assert fleet_seconds(cost, lengths, 4, 1000.0) == pytest.approx(want)
    f = physical_floor(cost, [lengths, lengths], 0.5, 0.2, 1, [1.0, 0.5], 4, 1000.0)
    assert f.work == pytest.approx(want / 3.0)  # two instances, one twice as fast: capacity 3
    alone = (cost.steps_time(1, 10, 40) + 10 / 1000) * 0.5
    assert f.tail == pytest.approx((0.5 + 0.2 + alone) / 2) and f.train == 0.5
    assert f.binds == max(("train", f.train), ("work", f.work), ("tail", f.tail), key=lambda x: x[1])[0]


def test_physical_floor_kv_bound_setting_preempts():
    """KV capacity binds: vLLM-style recompute preemption happens, the work term counts the KV-limited steps."""
    cfg = CONFIGS["kv-bound"]()
    r = run(cfg, "staleflow", 1)
    roomy = run(sim_config(**{**cfg.__dict__, "kv_capacity": 200000}), "staleflow", 1)
    assert r.violations == [] and r.preemptions > 0 and roomy.preemptions == 0
    assert r.floor.work > roomy.floor.work  # fewer sequences per step fit: more steps for the same tokens
