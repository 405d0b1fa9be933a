"""A pull in the simulator leaves sequences parked on a tool call where they are (coordinator/pull.py): the
parked KV is freed at the pull (it came from the old weights, unless keep-KV), the call goes on, and when it
returns the prefix plus the observation is prefilled under the new version; what still decodes at the pull
(one the coordinator thought parked) is interrupted by the instance, as the runtime's rank does. On the
agentic tiny workload StaleFlow interrupts no tool waiter at a pull or a migration and keeps its bound."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from staleflow.coordinator.cost_model import load_cost_model
from staleflow.coordinator.types import Interrupt, Pull
from staleflow.sim.backend import SimBackend
from staleflow.sim.engine import SimSequence
from staleflow.sim.hardware import derive
from staleflow.trajectory import Finished, Route

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import tiny_sim  # noqa: E402
from test_sim import Sim, audit  # noqa: E402
from test_sim_multi_turn import COST, PLAN, PREFILL, PROMPT, advance, agentic_tiny, instance, seq  # noqa: E402


@pytest.mark.parametrize("free_kv", [True, False])
def test_a_parked_sequence_stays_across_a_pull_and_reprefills_under_the_new_version(free_kv):
    inst = instance()
    inst.add(seq())
    turn_end = PROMPT / PREFILL + COST.steps_time(1, PROMPT, 10)
    advance(inst, turn_end + 0.1)
    assert inst.parked_ids() == (1,) and inst.kv == PROMPT + 10
    busy = inst.busy_s
    inst.pull(1, inst.t, 0.5, free_kv=free_kv)
    assert inst.parked_ids() == (1,) and inst.load() == 1  # still on the instance, its call still running
    assert inst.kv == (0 if free_kv else PROMPT + 10)  # the old-weight KV is gone (kept with keep-KV)
    (done,) = advance(inst, 10.0)
    assert inst.version == 1 and done.generated == 25 and inst.tool_calls == 1  # the call ran once
    prefill = (PROMPT + 15 if free_kv else 5) / PREFILL  # prefix + observation, or only the observation
    turn2 = COST.steps_time(1, PROMPT + 15, 10)
    assert done.t_done == pytest.approx(turn_end + 2.0 + prefill + turn2, abs=1e-9)  # the wake is after the sync
    assert inst.busy_s - busy == pytest.approx(prefill + turn2, abs=1e-9)
    assert inst.tokens_out == 20 and inst.parked_taken == {}


def test_a_woken_sequence_interrupted_before_admission_keeps_its_observation_and_reruns_nothing():
    """Its call returned (the runtime's extend appended the observation at once) and it waits in the engine
    queue: an Interrupt then (a pull's, a migration's) carries the observation in its record."""
    src, dst = instance(0), instance(1)
    src.add(seq())
    turn_end = PROMPT / PREFILL + COST.steps_time(1, PROMPT, 10)
    advance(src, turn_end + 0.01)
    src.max_running = 0  # from now on nothing is admitted: the woken sequence stays queued
    advance(src, turn_end + 2.5)  # the call returned at turn_end + 2: woken, not admitted
    assert src.parked_ids() == () and [w.traj_id for w in src.waiting] == [1] and src.tool_calls == 1
    (taken,) = src.take([1], "pull")
    assert taken.generated == 15 and src.parked_taken == {} and src.kv == 0  # prefix + observation
    dst.t = src.t
    dst.add(SimSequence(1, 0, PROMPT, PLAN.total, taken.generated, plan=PLAN))
    (done,) = advance(dst, dst.t + 5.0)
    assert done.generated == 25 and dst.tool_calls == 0 and dst.tokens_out == 10  # no call re-run


def sim_backend(pull_interrupts: bool) -> SimBackend:
    cfg = tiny_sim()
    cost = load_cost_model(cfg.cost_model)
    return SimBackend(cfg, derive(cfg, cost), cost, 1, 1, "ps", pull_interrupts=pull_interrupts)


@pytest.mark.parametrize("pull_interrupts", [True, False])
def test_the_instances_pull_interrupts_what_still_decodes_the_coordinator_thought_parked(pull_interrupts):
    be = sim_backend(pull_interrupts)
    be.route(Route(7, 0, 0, prompt_len=20, max_new_tokens=200))
    list(be.poll(0.05))
    assert 7 in be.insts[0].running
    be.pull(Pull(0, 1))  # no Interrupt named 7: the coordinator's snapshot had it parked
    got = [e for e in be.poll(be.t) if isinstance(e, Finished)]
    if pull_interrupts:
        assert [(e.traj_id, e.partial) for e in got] == [(7, True)] and not be.insts[0].holds(7)
        assert got[0].n_tokens > 0  # its partial output loops back, like an Interrupt's
    else:  # keep-KV (or drain): it decodes on across the load
        assert got == [] and 7 in be.insts[0].running


@pytest.mark.parametrize("mode", ["staleflow", "areal"])
def test_the_agentic_tiny_setting_interrupts_no_tool_waiter_at_pulls_and_keeps_the_bound(mode):
    """Partial rollout with re-prefill (the runtime's default; the simulated StaleFlow keeps KV by default,
    and then no pull interrupts anything) and a peer whose every update interrupts all in flight."""
    cfg = agentic_tiny(coordinator=dataclasses.replace(agentic_tiny().coordinator, keep_kv_on_pull=False))
    sim = Sim(cfg, mode, 1)
    be, cut, swept = sim.backend, [], []
    interrupt, pull = be.interrupt, be.pull

    def spy_interrupt(cmd: Interrupt):
        if cmd.reason in ("pull", "migrate"):
            parked = set(be.insts[cmd.instance].parked_ids())
            cut.extend((cmd.reason, t) for t in cmd.traj_ids if t in parked)
        interrupt(cmd)

    def spy_pull(cmd: Pull):
        n = len(be.pending)
        pull(cmd)
        swept.extend(e.traj_id for e in list(be.pending)[n:] if isinstance(e, Finished))

    be.interrupt, be.pull = spy_interrupt, spy_pull
    res = sim.run()
    audit(sim, res)
    c = sim.loop.coord.counters
    assert res.violations == [] and res.tool_calls > 0 and res.pulls > 0 and c["interrupted"] > 0
    assert c["pull_kept_parked"] > 0  # pulls did land while trajectories waited on their tools
    assert cut == []  # ... and none of them was interrupted (the old rule took every one)
    assert res.parked_taken.get("pull", 0) == res.parked_taken.get("migrate", 0) == 0
    assert swept == []  # the simulator's snapshots are exact at the tick: no race to sweep
