"""Simulator: protocol invariants over random small runs in every mode, the CLI, and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.config import ConfigError, CoordinatorConfig, StalenessConfig
from staleflow.coordinator import CostModel
from staleflow.modes import MODES as REGISTRY
from staleflow.modes import mode_of
from staleflow.sim.cli import main
from staleflow.sim.config import SimConfig, replace
from staleflow.sim.simulator import _result, build

MODES = tuple(REGISTRY)
sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import sim_config  # noqa: E402

TINY_COST = CostModel(k1=2e-6, k2=0.01, k3=1e-3, b3=0.004, k4=1e-3, kv_capacity=3000, name="tiny")


def tiny(**kw) -> SimConfig:
    return sim_config(
        **{
            **dict(
                prefill_tokens_per_s=5000.0,
                train_tokens_per_gpu_s=2000.0,
                push_s=0.2,
                pull_s=0.2,
                broadcast_s=0.3,
                colocated_switch_s=0.2,
                eta=(1,),
                steps=5,
                max_sim_s=3000.0,
                coordinator=CoordinatorConfig(migration=True, psi=2.0, migration_stop=1, phi_wait=1),
            ),
            **kw,
        }
    )


class Sim:
    """One simulated run built exactly as `run` builds it, kept open for the audit."""

    def __init__(self, cfg, mode, eta, cost=TINY_COST):
        self.cfg, self.mode = cfg, mode
        self.loop, self.backend, self.stale = build(cfg, mode, eta, cost=cost)

    def run(self):
        loop = self.loop
        loop.run(until=lambda: loop.done or self.backend.now() > self.cfg.max_sim_s)
        incomplete = "" if loop.done else "incomplete: max-sim-s"
        return _result(self.cfg, self.mode, self.stale.eta, self.mode, loop, self.backend, incomplete)


def audit(sim: Sim, res) -> None:
    """The protocol seen from outside the manager: bound, no loss, no double consumption."""
    assert not [v for v in res.violations if not v.startswith("incomplete")], res.violations
    assert res.steps_done == sim.cfg.steps, res.violations
    loop, led = sim.loop, sim.loop.ledger
    log = loop.manager.consumption_log()
    assert len({g for g, _, _ in log}) == len(log)  # no group consumed twice
    for _, tv, bv in log:
        assert tv <= bv
        assert bv <= tv + sim.stale.eta or not loop.manager.bounded  # the peers bound admission, not trajectories
    assert res.over_eta == sum(1 for _, tv, bv in log if bv > tv + sim.stale.eta)
    # every trajectory ever created has exactly one fate, and consumed ones match the trained samples
    assert not set(led.ended) & set(led.trajs)
    assert set(led.ended) | set(led.trajs) == set(range(led.next_traj))
    assert all(f == "consumed" or f.startswith("aborted: ") for f in led.ended.values())
    consumed = sum(1 for f in led.ended.values() if f == "consumed")
    assert consumed == sum(len(r.rewards) for r in loop.steps) == len(log) * sim.stale.group_size
    assert sum(res.staleness_hist.values()) == len(log)
    assert set(loop.coord.records) <= set(led.trajs)  # the coordinator schedules only live trajectories
    for inst in sim.backend.insts:  # nothing runs on an instance older than its V_traj
        for tr in list(inst.running.values()):
            assert inst.version >= tr.traj_version


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(MODES),
    eta=st.integers(0, 2),
    B=st.integers(1, 3),
    N=st.integers(1, 3),
    bred=st.integers(0, 2),
    gred=st.integers(0, 2),
    straggler=st.sampled_from(["off", "abort", "truncate"]),
    routing=st.sampled_from(["waterfall", "least-loaded", "round-robin"]),
    pull=st.sampled_from(["status", "greedy"]),
    mlq=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_random_runs_keep_the_staleness_invariant_and_lose_nothing(
    mode, eta, B, N, bred, gred, straggler, routing, pull, mlq, seed
):
    if mode == "verl-sync":
        eta = 0
    elif mode == "verl-one-step-off":
        eta = 1
    if mode_of(mode).peer and mode_of(mode).fixed_eta < 0:  # the peers' count-based protocols: no batch redundancy
        bred = 0
    cfg = tiny(
        staleness=StalenessConfig(
            batch_size=B, group_size=N, batch_redundancy=bred, group_redundancy=gred, straggler=straggler
        ),
        seed=seed,
        eta=(eta,),
        coordinator=CoordinatorConfig(
            routing=routing,
            pull=pull,
            mlq=mlq,
            mu=0.2,
            migration=True,
            psi=2.0,
            migration_stop=1,
            phi_wait=1,
            pull_indicator="requests",
            pull_threshold=2,
        ),
    )
    sim = Sim(cfg, mode, eta)
    audit(sim, sim.run())


def test_every_mode_finishes_and_staleflow_is_not_slower_than_sync():
    cfg = tiny(steps=6, eta=(2,))
    rates = {}
    for mode in MODES:
        sim = Sim(cfg, mode, 2)
        res = sim.run()
        audit(sim, res)
        rates[mode] = res.tokens_per_s
        assert max(res.staleness_hist) <= sim.stale.eta or not sim.loop.manager.bounded
    assert rates["staleflow"] > rates["verl-sync"] > 0


def test_cli_prints_table_and_ratio_json(tmp_path, capsys):
    cm = tmp_path / "cm.json"
    cm.write_text(
        json.dumps(
            {
                "k1": TINY_COST.k1,
                "k2": TINY_COST.k2,
                "k3": TINY_COST.k3,
                "b3": TINY_COST.b3,
                "k4": TINY_COST.k4,
                "kv_capacity": TINY_COST.kv_capacity,
            }
        )
    )
    args = [
        "--preset",
        "cpu-small",
        "--cost-model",
        str(cm),
        "--steps",
        "4",
        "--warmup-steps",
        "1",
        "--eta",
        "1",
        "--max-response",
        "120",
        "--out-dir",
        str(tmp_path / "out"),
        "--no-ablation",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    keys = ("vs_sync", "vs_best_async", "vs_verl_one_step_off", "vs_verl_fully_async", "vs_areal")
    assert set(keys) <= set(summary) and summary["violations"] == 0
    assert all(summary[k] > 0 for k in keys) and summary["best_async"] in (
        "verl-one-step-off",
        "verl-fully-async",
        "areal",
    )
    assert summary["vs_best_async"] == min(summary[k] for k in keys[2:])
    assert any(line.startswith("verl-sync ") for line in out) and (tmp_path / "out" / "sim.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--preset", "paper-64b"], "--preset='paper-64b' is unknown"),
        (["--modes", "staleflow", "verl"], "unknown mode"),
        (["--length-dist", "pareto"], "--length-dist"),
        (["--staleness.batch-size", "-2"], "--staleness.batch-size=-2"),
        (["--rollout-gpus", "128"], "--rollout-gpus=128"),
        (["--warmup-steps", "12", "--steps", "12"], "--warmup-steps=12"),
        (["--cost-model", "no-such-model"], "neither a preset"),
    ],
)
def test_bad_input_is_a_clear_config_error(argv, match, capsys):
    """Either our own ConfigError, or tyro's exit 2 after printing the same one-line message."""
    try:
        main(argv)
    except ConfigError as e:
        assert match in str(e)
    except SystemExit as e:
        assert e.code == 2 and match in " ".join(capsys.readouterr().err.split()).replace("│ ", "")
    else:
        pytest.fail(f"{argv} was accepted")


def test_bad_lengths_file(tmp_path):
    p = tmp_path / "lens.txt"
    p.write_text("100\n-3\n")
    with pytest.raises(ConfigError, match="entry 2 is -3"):
        Sim(tiny(lengths_file=str(p)), "staleflow", 1)
    assert replace(tiny(), seed=3).seed == 3
