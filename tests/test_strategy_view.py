"""Strategies read a frozen view of the coordinator and return commands; the coordinator checks and applies
them (coordinator/view.py, Coordinator.apply). A fork's strategy that tries to write gets an error and the
scheduling state is untouched; a command the state does not allow is refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_coordinator import force, hold, loaded, make, routes, set_version, traj  # noqa: E402

from staleflow.coordinator import Abort, Interrupt, Pull, Route  # noqa: E402
from staleflow.coordinator.migration import Migration  # noqa: E402
from staleflow.coordinator.pull import GreedyPull, PullPlanner  # noqa: E402
from staleflow.coordinator.strategies import PLANNERS, ROUTING, Waterfall  # noqa: E402


def state(c) -> tuple:
    """Everything a strategy could corrupt: the records, the instances, the queue, the coordinator's scalars."""
    recs = {
        t: (r.state, r.instance, r.kv, r.reserved, r.parked, r.migrated_at, r.moved_off) for t, r in c.records.items()
    }
    insts = {
        i: (s.version, s.target_version, tuple(s.trajs), s.kv_tokens, s.waiting, s.syncing, s.draining)
        for i, s in c.instances.items()
    }
    return recs, insts, tuple(c.queue.ids()), c.ps_version, c.in_flight, dict(c.group_tag)


class Hostile:
    """A routing strategy that tries every write it can reach, then routes like least-loaded."""

    errors: list = []

    def __init__(self, cfg, cost_model):
        pass

    def choose(self, traj, traj_version, candidates, ctx):
        inst = candidates[0]
        attempts = [
            lambda: setattr(inst, "kv_tokens", 0),
            lambda: setattr(inst, "target_version", 99),
            lambda: inst.trajs.clear(),
            lambda: setattr(ctx, "ps_version", 7),
            lambda: ctx.instances.pop(inst.instance),
            lambda: setattr(ctx.record(traj.traj_id), "moved_off", 3),
            lambda: ctx.records().clear(),
            lambda: ctx.group_versions().clear(),
            lambda: setattr(ctx, "cfg", None),
        ]
        for held in inst.trajs.values():
            attempts.append(lambda held=held: setattr(held, "instance", -1))
        for attempt in attempts:
            try:
                attempt()
            except (AttributeError, TypeError) as e:
                Hostile.errors.append(type(e).__name__)
            else:
                Hostile.errors.append("WROTE")
        return min(candidates, key=lambda i: (i.load, i.instance))


def test_strategy_view_a_hostile_router_cannot_write_the_coordinators_state():
    ROUTING["test-hostile"] = Hostile
    try:
        c, m = make(n_inst=2, eta=1, routing="test-hostile")
        hold(c, 0, 500)
        c.submit([traj(c, 1, 1, None, 10)])
        before = state(c)
        Hostile.errors.clear()
        got = routes(c.tick(1.0))
        assert got == [(1, 1, 0)] and Hostile.errors and "WROTE" not in Hostile.errors
        recs, insts, queue, ps, in_flight, tags = before
        after = state(c)
        assert after[0][500] == recs[500] and after[1][0] == insts[0]  # what it tried to change did not change
        assert after[0][1][:2] == ("in_flight", 1) and after[3] == ps and after[4] == in_flight + 1  # its route did
    finally:
        del ROUTING["test-hostile"]


def test_strategy_view_the_built_in_strategies_only_read_a_frozen_view():
    """Hand each built-in strategy the view of a busy coordinator: the state is the same after, and what
    they decide comes back as commands."""
    c, m = make(n_inst=3, eta=1, version=0, migration=True, psi=2.0, migration_stop=1)
    loaded(c, 1, 4)
    loaded(c, 2, 2)
    c.now = 1.0  # (a tick in progress)
    view, before = c.view, state(c)
    moves = list(Migration(c.cfg, c.cost_model).plan(view, 1.0))  # instance 0 starves: nothing is queued
    assert moves == [Interrupt(1, tuple(c.instances[1].trajs), "migrate")] and state(c) == before
    c.submit([traj(c, 1, 1, None, 10)])
    before = state(c)
    inst = Waterfall(c.cfg, c.cost_model).choose(c.trajs[1], None, list(c.instances.values()), view)
    assert inst is c.instances[0] and state(c) == before
    m.version = 1
    c.on_new_version(1)
    before = state(c)
    pulls = list(PullPlanner(GreedyPull(c.cfg, c.cost_model)).plan(view, 1.0))
    assert pulls and all(isinstance(p, Pull) and p.version == 1 for p in pulls) and state(c) == before


class Lanes:
    """A planner fork: routes the oldest queued trajectory to the emptiest instance itself, and once moves an
    instance's work off it (a command-returning strategy, as a critical-path lane would)."""

    def __init__(self, cfg, cost_model):
        self.moved = False

    def plan(self, ctx, now):
        queued = list(ctx.queued_ids())
        if queued:
            t = queued[0]
            lane = min(ctx.instances.values(), key=lambda i: (i.load, i.instance))
            V = ctx.trajs[t].traj_version
            yield Route(t, lane.instance, lane.target_version if V is None else V)
        busy = max(ctx.instances.values(), key=lambda i: i.load)
        if not self.moved and busy.load >= 2:
            self.moved = True
            yield Interrupt(busy.instance, tuple(busy.trajs)[:1], "migrate")


def test_strategy_view_a_planner_routes_and_migrates_through_commands():
    PLANNERS["test-lanes"] = Lanes
    try:
        c, m = make(n_inst=2, eta=1, migration=False, planners=("test-lanes",))
        loaded(c, 0, 3)
        c.submit([traj(c, 1, 1, None, 10), traj(c, 2, 2, None, 10)])
        cmds = c.tick(1.0)
        assert cmds[0] == Route(1, 1, 0)  # the planner's route, before the routing pass
        assert cmds[1] == Interrupt(0, (1000,), "migrate")  # its move: recorded as a migration
        assert c.records[1000].state == "interrupting" and c.records[1000].moved_off == 0
        assert c.counters["migrations"] == 1 and routes(cmds[2:]) == []  # routing waits for the loop-back
        assert m.group_info(1)["state"] == "reserved" and c.group_version(1) == 0
    finally:
        del PLANNERS["test-lanes"]


def test_strategy_view_a_command_the_state_does_not_allow_is_refused_by_name():
    c, m = make(n_inst=2, eta=1, version=1)
    set_version(c, 0, 0)
    set_version(c, 1, 1)
    hold(c, 0, 500)
    c.submit([traj(c, 1, 1, 1, 10)])  # tagged V_traj 1
    before, out = state(c), []
    bad = [
        (Route(1, 0, 1), "runs version 0"),  # an instance older than its V_traj: the bound's rule
        (Route(500, 1, 0), "not queued"),
        (Interrupt(1, (500,), "migrate"), "not held"),
        (Interrupt(0, (500,), "pull"), "migrate or truncate"),
        (Pull(1, 1), "cannot pull"),  # it runs version 1 already
        (Abort(0, (500,), "x"), "whole groups"),
    ]
    for cmd, why in bad:
        with pytest.raises(ValueError, match=why):
            c.apply(cmd, 1.0, out)
    assert out == [] and state(c) == before
    force(c.instances[1], draining=True)
    with pytest.raises(ValueError, match="draining True"):
        c.apply(Route(1, 1, 1), 1.0, out)


class OffList:
    """A router that answers with an instance it was not offered (instance 0 is full)."""

    def __init__(self, cfg, cost_model):
        pass

    def choose(self, traj, traj_version, candidates, ctx):
        return ctx.instances[0]


def test_strategy_view_a_router_must_choose_one_of_its_candidates():
    ROUTING["test-off-list"] = OffList
    try:
        c, m = make(n_inst=2, eta=1, routing="test-off-list", pull="idle", max_concurrent=1)
        hold(c, 0, 500)
        c.submit([traj(c, 1, 1, None, 10)])
        with pytest.raises(ValueError, match=r"chose instance 0, not one of its candidates \[1\]"):
            c.tick(1.0)
        assert c.records[1].state == "queued" and c.in_flight == 1 and m.stats()["groups_in_flight"] == 0
    finally:
        del ROUTING["test-off-list"]
