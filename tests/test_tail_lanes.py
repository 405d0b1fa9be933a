"""Critical-path tail lanes (coordinator/lanes.py, --coordinator.tail-lanes): the trajectories that hold back the
oldest buffer get an instance the routing pass no longer feeds, the other work there is given back, the lane
closes when its critical work is done, and the staleness bound holds: in the simulator and on the real runtime."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from staleflow.coordinator import coordinator as coordinator_module
from staleflow.coordinator.lanes import critical
from staleflow.coordinator.routing import RoutingPass
from staleflow.coordinator.types import Interrupt, Lane
from staleflow.sim.simulator import run
from staleflow.trajectory import Route

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import sim_config  # noqa: E402

HERE = Path(__file__).parent


def lane_config(**kw):
    """A small long-tailed workload on 4 instances where a buffer's last trajectories decode well after the rest."""
    base = dict(
        total_gpus=6, rollout_gpus=4, response_sigma=1.0, max_response=400, steps=10, warmup_steps=2, spec_accept=1.0
    )
    cfg = sim_config(**{**base, **kw})
    return dataclasses.replace(cfg, coordinator=dataclasses.replace(cfg.coordinator, tail_lanes=True))


def test_tail_lane_opens_in_the_tail_feeds_nothing_else_and_the_bound_holds(monkeypatch):
    """Every Lane the planner opens is on an instance holding a critical trajectory; the other trajectories decoding
    there are given back in the same tick; the routing pass routes nothing to an open lane; a lane closes once no
    critical trajectory is on it."""
    seen = {"open": 0, "closed": 0, "given_back": 0, "routing_pass_routes": 0}
    apply = coordinator_module.Coordinator.apply

    def spy_apply(self, cmd, now, out):
        if isinstance(cmd, Lane):
            crit = critical(self.view)
            held = set(self.instances[cmd.instance].trajs)
            if cmd.open:
                assert held & set(crit), "a lane opened without a critical trajectory on it"
                seen["open"] += 1
            else:
                assert not held & set(crit), "a lane closed while a critical trajectory decodes on it"
                seen["closed"] += 1
        elif isinstance(cmd, Interrupt) and cmd.reason == "migrate" and self.instances[cmd.instance].lane:
            assert not set(cmd.traj_ids) & set(critical(self.view))  # only the non-critical work is given back
            seen["given_back"] += len(cmd.traj_ids)
        return apply(self, cmd, now, out)

    route_pass = RoutingPass.run

    def spy_run(self, now, cmds):
        before = len(cmds)
        route_pass(self, now, cmds)
        for cmd in cmds[before:]:
            if isinstance(cmd, Route):
                seen["routing_pass_routes"] += 1
                assert not self.c.instances[cmd.instance].lane, "the routing pass routed to a tail lane"

    monkeypatch.setattr(coordinator_module.Coordinator, "apply", spy_apply)
    monkeypatch.setattr(RoutingPass, "run", spy_run)
    for seed in (0, 1):
        r = run(dataclasses.replace(lane_config(), seed=seed), "staleflow", 1)
        assert r.violations == [] and max(r.staleness_hist) <= 1 and r.lanes > 0
    assert seen["open"] > 0 and seen["closed"] > 0 and seen["given_back"] > 0 and seen["routing_pass_routes"] > 0


def test_tail_lane_planner_is_off_by_default_on_the_runtime_and_for_every_peer():
    from staleflow.config import CoordinatorConfig
    from staleflow.modes import apply_mode, peers

    on = dataclasses.replace(CoordinatorConfig(), tail_lanes=True)
    assert CoordinatorConfig().tail_lanes is False  # the runtime's default: docs/perf.md has the runtime's run
    assert all(apply_mode(m.name, on)[0].tail_lanes is False for m in peers())  # a peer's system has no lanes
    assert apply_mode("staleflow", on)[0].tail_lanes is True


def test_tail_lane_critical_slowdown_is_measured_per_step():
    """The simulator reports the critical response's wall time over its decode alone (one token per step)."""
    r = run(lane_config(), "staleflow", 1)
    off = run(
        dataclasses.replace(
            lane_config(), coordinator=dataclasses.replace(lane_config().coordinator, tail_lanes=False)
        ),
        "staleflow",
        1,
    )
    assert r.critical_slowdown > 0.8 and off.critical_slowdown > 0.8 and off.lanes == 0


def test_tail_lane_critical_measure_sees_every_trained_member_interrupted_or_not(monkeypatch):
    """The critical response is the last-finishing of ALL the batch's members: one that looped back (interrupted,
    migrated to or off a lane) keeps its first route and its moved KV when the loop frees its superseded
    record (sim/backend.free). Before, freeing the older record forgot both, so the measure skipped exactly the
    long, interrupted responses."""
    from staleflow.sim import backend as backend_mod

    seen = {"members": 0, "unseen": 0, "looped_back": 0}
    train, loop_back = backend_mod.SimBackend.train, backend_mod.SimBackend._loop_back

    def spy_train(self, version, batch):
        for g in batch:
            for t in g.traj_ids:
                seen["members"] += 1
                seen["unseen"] += self.first_route.get(t, (0.0, -1.0))[1] < 0
        return train(self, version, batch)

    def spy_loop_back(self, tr, instance):
        seen["looped_back"] += 1
        return loop_back(self, tr, instance)

    monkeypatch.setattr(backend_mod.SimBackend, "train", spy_train)
    monkeypatch.setattr(backend_mod.SimBackend, "_loop_back", spy_loop_back)
    r = run(lane_config(), "staleflow", 1)
    assert r.violations == [] and r.lanes > 0 and seen["looped_back"] > 0 and seen["members"] > 0
    assert seen["unseen"] == 0, f"{seen['unseen']} of {seen['members']} trained members unseen by the critical measure"


@pytest.mark.slow
def test_tail_lane_forms_on_the_real_runtime_and_the_bound_holds(tmp_path):
    """The tiny preset with long-tailed lengths, 1 trainer + 2 rollout ranks: the shared controller opens lanes
    (the rank executes the given-back Interrupts), every trained group is within eta, nothing is trained twice."""
    from run_helpers import QUIET, metrics_rows, train_tiny
    from test_e2e import _check_audit

    eta = 1
    flags = ("--steps", "4", "--staleness.eta", str(eta), "--coordinator.tail-lanes")
    train_tiny(
        tmp_path, "run", *flags, "--rollout.length-dist", "lognormal:16:1.0", "--rollout.max-new-tokens", "96", *QUIET
    )
    rows = metrics_rows(tmp_path / "run")
    assert rows[-1]["lanes_opened"] > 0 and rows[-1]["migrations"] > 0  # a lane formed, its other work given back
    assert all(r["bound_violations"] == 0 and r["staleness_max"] <= eta for r in rows)
    _check_audit(str(tmp_path / "run"), eta)
