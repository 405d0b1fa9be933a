"""Multi-turn, tool-using trajectories in the simulator (sim/turns.py, sim/engine.py, sim/floor.py, the grid's
agentic setting): a tool wait holds the sequence's KV and decodes nothing, the trajectory's wall time includes
its waits, a trajectory taken off while it waits re-prefills its prefix and re-runs the call, the physical floor
with tool time stays below every run's measured step, and the agentic setting runs."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.config import StalenessConfig
from staleflow.coordinator.cost_model import CostModel
from staleflow.sim import grid
from staleflow.sim.engine import SimInstance, SimSequence
from staleflow.sim.floor import alone_s, fleet_seconds, physical_floor
from staleflow.sim.simulator import SimWorkload, run
from staleflow.sim.turns import TurnPlan, TurnSampler, lognormal_sigma

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import tiny_sim  # noqa: E402
from test_sim import Sim, audit, tiny  # noqa: E402

COST = CostModel(k1=1e-5, k2=0.01, k3=0.0, b3=0.0, k4=0.0, kv_capacity=10_000)
PREFILL = 1000.0
PROMPT = 20
# two turns of 10 model tokens with one tool call (2 s, 5 observation tokens) between them
PLAN = TurnPlan(ends=(10,), tool_s=(2.0,), obs=5, total=25)


def instance(i: int = 0) -> SimInstance:
    return SimInstance(i, COST, PREFILL, max_running=8)


def seq(tid: int = 1, plan: TurnPlan | None = PLAN, generated: int = 0) -> SimSequence:
    return SimSequence(tid, 0, PROMPT, plan.total if plan else 20, generated, plan=plan)


def advance(inst: SimInstance, until: float, dt: float = 0.05) -> list[SimSequence]:
    done = []
    while inst.t < until - 1e-12:
        done += inst.advance(min(until, inst.t + dt))[0]
    return done


def expected_done(tool_s: float) -> float:
    """Alone, no noise, prefill stopping decode: prompt prefill, turn 1, the tool, the observation, turn 2."""
    turn1 = COST.steps_time(1, PROMPT, 10)
    turn2 = COST.steps_time(1, PROMPT + 15, 10)
    return PROMPT / PREFILL + turn1 + tool_s + 5 / PREFILL + turn2


def test_multi_turn_tool_wait_holds_kv_and_does_not_decode():
    inst = instance()
    inst.add(seq())
    turn_end = PROMPT / PREFILL + COST.steps_time(1, PROMPT, 10)
    advance(inst, turn_end + 0.1)
    # parked: out of the running batch, its prompt + first turn resident in the KV, nothing read by decode steps
    assert 1 in inst.held and not inst.running and inst.holds(1)
    assert inst.kv == PROMPT + 10 and inst.kv_run == 0
    out, step = inst.tokens_out, inst.step
    assert out == 10
    advance(inst, turn_end + 1.9)  # the whole wait: no token is decoded
    assert (inst.tokens_out, inst.step, inst.kv) == (out, step, PROMPT + 10)
    done = advance(inst, 10.0)
    assert [s.traj_id for s in done] == [1] and done[0].generated == 25
    assert inst.tokens_out == 20  # the observation's 5 tokens were prefilled, not decoded
    assert inst.kv == 0 and not inst.held and inst.tool_calls == 1 and inst.tool_s == 2.0


def test_multi_turn_co_runner_decodes_while_a_sequence_waits_for_its_tool():
    inst = instance()
    inst.add(seq(1))
    inst.add(seq(2, plan=None))
    done = advance(inst, 1.0)  # seq 2 (20 tokens) finishes during seq 1's 2 s wait
    assert [s.traj_id for s in done] == [2] and 1 in inst.held
    assert inst.kv == PROMPT + 10 and inst.kv_run == 0


def test_multi_turn_wall_time_includes_its_tool_waits():
    times = {}
    for tool_s in (0.0, 2.0, 7.5):
        inst = instance()
        plan = dataclasses.replace(PLAN, tool_s=(tool_s,))
        inst.add(seq(plan=plan))
        (done,) = advance(inst, 20.0)
        times[tool_s] = done.t_done
        assert done.t_done == pytest.approx(expected_done(tool_s), abs=1e-9)
    assert times[7.5] - times[0.0] == pytest.approx(7.5, abs=1e-9)


def test_multi_turn_interrupt_while_waiting_reprefills_and_reruns_the_call():
    src, dst = instance(0), instance(1)
    src.add(seq())
    advance(src, 0.5)  # turn 1 done, waiting for the tool
    (taken,) = src.take([1])
    assert taken.generated == 10 and taken.had_kv and src.kv == 0 and not src.held and src.tool_calls == 0
    # the loop-back resumes on another instance from its record (prompt + 10 tokens, no observation)
    dst.t = src.t
    t0 = dst.t
    dst.add(SimSequence(1, 0, PROMPT, PLAN.total, taken.generated, plan=PLAN))
    advance(dst, t0 + 0.05)
    assert 1 in dst.held and dst.kv == PROMPT + 10  # prefix re-prefilled, waiting for the re-run call
    (done,) = advance(dst, t0 + 10.0)
    reprefill = (PROMPT + 10) / PREFILL
    turn2 = 5 / PREFILL + COST.steps_time(1, PROMPT + 15, 10)
    # the call is re-run in full (2 s from the resume, overlapping the prefix's re-prefill), then only the
    # observation is prefilled; the instance paid the re-prefill
    assert done.t_done == pytest.approx(t0 + 2.0 + turn2, abs=1e-9) and done.generated == 25
    assert dst.busy_s == pytest.approx(reprefill + turn2, abs=1e-9)
    assert dst.tool_calls == 1 and dst.tokens_out == 10  # the second turn only: the first is not decoded again


def test_multi_turn_kv_overflow_evicts_a_parked_sequence_which_reprefills_on_resume():
    cost = dataclasses.replace(COST, kv_capacity=60)
    inst = SimInstance(0, cost, PREFILL, max_running=8)
    long_plan = TurnPlan(ends=(10,), tool_s=(5.0,), obs=5, total=25)
    inst.add(seq(1, plan=long_plan))
    advance(inst, 0.2)
    assert inst.kv == 30 and 1 in inst.held
    inst.add(seq(2, plan=None, generated=0))  # 20 + 20 tokens: 30 + 40 > 60 once it decodes
    done = advance(inst, 1.0)
    assert [s.traj_id for s in done] == [2] and inst.preemptions >= 1
    assert not inst.held[1].resident and inst.kv == 0  # its KV was freed for the running sequence
    (done,) = advance(inst, 10.0)
    assert done.traj_id == 1 and done.generated == 25


def test_multi_turn_plans_split_the_model_tokens_and_draw_the_latency_tail():
    s = TurnSampler(4, 8, 2.0, 30.0, 300, random.Random(0))
    plans = [s(n) for n in (5000,) * 2000]
    assert all(4 <= p.calls <= 8 and p.total == 5000 + 300 * p.calls and p.model_tokens == 5000 for p in plans)
    for p in plans[:50]:  # every turn decodes >= 1 token; observations sit between turns
        gaps = [b - a for a, b in zip((0,) + tuple(e + p.obs for e in p.ends), p.ends + (p.total,))]
        assert min(gaps) >= 1 and sum(gaps) == p.model_tokens
    lat = sorted(x for p in plans for x in p.tool_s)
    assert lat[len(lat) // 2] == pytest.approx(2.0, rel=0.1) and lat[int(0.99 * len(lat))] == pytest.approx(
        30, rel=0.25
    )
    assert lognormal_sigma(2.0, 30.0) == pytest.approx(1.164, abs=1e-3)
    assert s(3).calls == 2  # a 3-token response has room for 2 calls at most
    # the workload draws the same lengths with and without tools (its own stream for the plans)
    a, b = SimWorkload(tiny_sim(), random.Random(1)), SimWorkload(agentic_tiny(), random.Random(1))
    for _ in range(20):
        (sa, na), (sb, nb) = a.new_member(), b.new_member()
        assert sa == 0 and nb == b.plans[sb].total and na == b.plans[sb].model_tokens


def agentic_tiny(**kw):
    """The agentic setting's workload on the tiny config (short latencies: the tiny model decodes fast)."""
    return tiny_sim(
        tool_calls_min=2,
        tool_calls_max=4,
        tool_latency_median_s=0.2,
        tool_latency_p99_s=3.0,
        tool_obs_tokens=15,
        steps=10,
        **kw,
    )


RUNS = [
    ("verl-sync", 0, {}),
    ("verl-one-step-off", 1, {}),
    ("verl-fully-async", 1, {}),
    ("verl-fully-async", 1, {"staleness_threshold": 0.0, "trigger_sync_steps": 2}),
    ("areal", 2, {}),
    ("staleflow", 1, {}),
    ("staleflow", 3, {}),
]


@pytest.mark.parametrize("kv_bound", [False, True])
def test_multi_turn_physical_floor_with_tool_time_is_never_above_a_runs_measured_step(kv_bound):
    cfg = agentic_tiny(
        **(dict(kv_capacity=1500, staleness=StalenessConfig(batch_size=8, group_size=4)) if kv_bound else {})
    )
    for mode, eta, peer in RUNS:
        r = run(cfg, mode, eta, peer=peer)
        assert r.violations == [] and r.floor is not None and r.tool_calls > 0
        f = r.floor
        assert 0 < f.floor <= r.step_s, (mode, eta, peer, f.row(), r.step_s)
        assert r.wall_p99 >= r.wall_p50 > 0
    if kv_bound:
        assert r.preemptions > 0  # the KV-bound case evicts or preempts


def test_multi_turn_floor_terms_count_tool_time_in_the_tail_not_in_the_work():
    single = [(10, 40)]
    multi = [(10, 40, 30, 6.0)]  # 40 model tokens, 30 observation tokens, 6 s of tools
    w1, w2 = fleet_seconds(COST, single, 4, PREFILL), fleet_seconds(COST, multi, 4, PREFILL)
    assert w2 - w1 == pytest.approx(30 / PREFILL)  # only the observations' prefill: tool waits cost no compute
    assert alone_s(COST, multi[0], PREFILL, 0.5) == pytest.approx(alone_s(COST, single[0], PREFILL, 0.5) + 0.015 + 6.0)
    f1 = physical_floor(COST, [single], 0.1, 0.2, 1, [1.0, 0.5], 4, PREFILL)
    f2 = physical_floor(COST, [multi + [(10, 50)]], 0.1, 0.2, 1, [1.0, 0.5], 4, PREFILL)
    # the tail follows the trajectory with the longest critical path (its tools), not the longest response
    assert f2.tail == pytest.approx((0.1 + 0.2 + alone_s(COST, multi[0], PREFILL, 0.5)) / 2)
    assert f2.tail > f1.tail + 2.9


def test_multi_turn_agentic_setting_is_in_the_grid_and_runs(tmp_path, capsys):
    shapes = {sh.name: sh for sh in grid.settings()}
    ag = shapes["7B agentic 64:64"]
    assert [sh.name for sh in grid.settings() if grid._matches("agentic", sh.name)] == [ag.name]
    cfg = grid.setting_cfg(grid.SimConfig(), ag)
    assert (cfg.tool_calls_min, cfg.tool_calls_max, cfg.tool_obs_tokens) == (4, 8, 300)
    assert cfg.tool_latency_p99_s > 10 * cfg.tool_latency_median_s / 2  # heavy-tailed
    # a tiny version of it through the whole grid: peer search, StaleFlow, equal transfer, strict, the JSON line
    short = (("tool_latency_median_s", 0.2), ("tool_latency_p99_s", 3.0), ("tool_obs_tokens", 15))
    tiny = dataclasses.replace(ag, split=(3, 1), workload=ag.workload[:2] + short, etas=(1,), search="reduced")
    base = tiny_sim(router_fit_samples=50, jobs=1, steps=6, out_dir=str(tmp_path))
    sets, *_ = grid.run_grid(base, 1, lambda text: None, [tiny], (tiny.name, 1), (), sweep=False)
    (st,) = sets
    assert st.cfg.tool_calls_max == 8 and all(r.tool_calls > 0 and not r.violations for r in st.results())
    from staleflow.sim import grid_report as rep
    from staleflow.sim import grid_tables as tab

    (row,) = rep.setting_rows(st, st.etas, grid.SEEDS)
    assert row["guarantee_best"] and row["vs_guarantee_best"] > 0 and row["step_over_floor"] >= 1.0
    assert row["tools"]["staleflow_wall_p99"] >= row["tools"]["staleflow_wall_p50"] > 0
    assert "tools, eta 1:" in tab.setting_text(st, st.etas, grid.SEEDS)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["staleflow", "verl-fully-async", "areal", "verl-sync", "verl-one-step-off"]),
    eta=st.integers(0, 2),
    B=st.integers(1, 3),
    N=st.integers(1, 3),
    calls=st.tuples(st.integers(0, 3), st.integers(1, 4)),
    kv=st.sampled_from([None, 500]),
    keep_kv=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_multi_turn_random_runs_keep_the_protocol_and_the_kv_accounting(mode, eta, B, N, calls, kv, keep_kv, seed):
    """Parking, waking, evicting and interrupting waiting sequences lose no trajectory and break no bound."""
    eta = {"verl-sync": 0, "verl-one-step-off": 1}.get(mode, eta)
    cfg = tiny(
        staleness=StalenessConfig(batch_size=B, group_size=N),
        seed=seed,
        eta=(eta,),
        tool_calls_min=min(calls),
        tool_calls_max=max(calls),
        tool_latency_median_s=0.1,
        tool_latency_p99_s=2.0,
        tool_obs_tokens=10,
        coordinator=dataclasses.replace(tiny().coordinator, keep_kv_on_pull=keep_kv),
    )
    cost = dataclasses.replace(TINY, kv_capacity=kv) if kv else TINY
    sim = Sim(cfg, mode, eta, cost=cost)
    res = sim.run()
    audit(sim, res)
    if min(calls) > 0:  # every trajectory of more than one token then has >= 1 call (0 calls may be drawn for all)
        assert res.tool_calls > 0
    assert res.parked_taken.get("pull", 0) == res.parked_taken.get("migrate", 0) == 0  # tool waiters stay
    for inst in sim.backend.insts:
        assert not inst.running.keys() & inst.held.keys()
        assert inst.kv_held == sum(s.tokens for s in inst.held.values() if s.resident) and inst.kv >= 0
    trained = [t for r in sim.loop.steps for g in r.groups for t, n in zip(g.traj_ids, g.n_tokens)]
    assert all(sim.backend.plan_of[t] is not None for t in trained)


TINY = CostModel(k1=2e-6, k2=0.01, k3=1e-3, b3=0.004, k4=1e-3, kv_capacity=3000, name="tiny")


def test_multi_turn_bad_tool_flags_are_one_line_config_errors():
    from staleflow.config import ConfigError
    from staleflow.sim.config import SimConfig

    for kw, flag in (
        (dict(tool_calls_min=5, tool_calls_max=2), "--tool-calls-max=2"),
        (dict(tool_latency_median_s=3.0, tool_latency_p99_s=1.0), "--tool-latency-p99-s=1.0"),
        (dict(tool_obs_tokens=-1), "--tool-obs-tokens=-1"),
    ):
        with pytest.raises(ConfigError, match=flag):
            SimConfig(**kw)
