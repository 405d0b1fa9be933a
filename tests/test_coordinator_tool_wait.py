"""Trajectories parked on a tool call (the snapshot's parked_ids): a pull leaves them on their instance,
migration never picks them nor counts them, and a loop-back the coordinator did not ask for (the
instance's own pull found one decoding again: the snapshot was a tick old) is taken like any other."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).parent))
from test_coordinator import COST, Clock, force, hold, loaded, loop_back, make, routes, snap, traj  # noqa: E402

from staleflow.coordinator import InstanceSnapshot, Interrupt, Pull  # noqa: E402
from staleflow.coordinator.record import PARK  # noqa: E402


def placed(c, ids, t=1.0):
    """Submit and route trajectories (one group each) to the coordinator's single instance."""
    c.submit([traj(c, tid, tid, None, 10) for tid in ids])
    got = routes(c.tick(t))
    assert sorted(x[0] for x in got) == sorted(ids)


def new_version(c, m, v=1):
    m.version = v
    c.on_new_version(v)


def test_a_snapshot_counts_parked_trajectories_and_the_instance_keeps_them():
    clock = Clock()
    c, m = make(n_inst=1, eta=1, clock=clock)
    placed(c, [1, 2, 3])
    inst = c.instances[0]
    assert not c.on_snapshot(snap(c, 0, t=1.5, running=1))  # 2 of 3 unaccounted for: dropped
    assert c.on_snapshot(snap(c, 0, t=1.5, running=1, parked_ids=(2, 3)))
    assert inst.parked == {2, 3} and inst.running == 1 and inst.load == 3
    clock.t = 2.0
    assert c.on_finished(0, 2)
    assert inst.parked == {3} and inst.running == 1
    assert c.on_snapshot(snap(c, 0, t=2.5, running=2))  # an old sender (no parked_ids): nothing parked
    assert inst.parked == set() and inst.running == 2


def test_a_pull_interrupts_everything_but_the_tool_waiters():
    c, m = make(n_inst=1, eta=1, pull="greedy")
    placed(c, [1, 2, 3])
    assert c.on_snapshot(snap(c, 0, t=1.5, running=1, parked_ids=(2, 3)))
    new_version(c, m)
    cmds = c.tick(2.0)
    assert cmds[:2] == [Interrupt(0, (1,), "pull"), Pull(0, 1)]
    assert (
        {t for t, r in c.records.items() if r.interrupting} == {1}
        and c.counters["interrupted"] == 1
        and c.counters["pull_kept_parked"] == 2
    )
    assert (
        c.instance_of(2) == c.instance_of(3) == 0 and c.records[2].reserved and c.records[3].reserved
    )  # still occupying the instance
    c.on_pull_done(0, 1)
    assert c.on_finished(0, 2)  # its next turn ran there, under the new weights
    assert c.counters["finished"] == 1 and c.instance_of(3) == 0


def test_a_pull_with_only_tool_waiters_sends_no_interrupt_and_routing_goes_on():
    c, m = make(n_inst=1, eta=1, pull="greedy")
    placed(c, [1, 2])
    assert c.on_snapshot(snap(c, 0, t=1.5, running=0, parked_ids=(1, 2)))
    new_version(c, m)
    c.submit([traj(c, 5, 5, None, 10)])
    cmds = c.tick(2.0)
    assert not any(isinstance(x, Interrupt) for x in cmds) and Pull(0, 1) in cmds
    assert routes(cmds) == [(5, 0, 1)]  # nothing to wait for: the fresh group is tagged with the new version


def test_keep_kv_and_drain_pulls_are_unchanged_by_parked_trajectories():
    c, m = make(n_inst=1, eta=1, pull="greedy", keep_kv_on_pull=True)
    placed(c, [1, 2])
    assert c.on_snapshot(snap(c, 0, t=1.5, running=1, parked_ids=(2,)))
    new_version(c, m)
    cmds = c.tick(2.0)
    assert not any(isinstance(x, Interrupt) for x in cmds) and Pull(0, 1) in cmds
    d, md = make(n_inst=1, eta=1, pull="greedy", interrupt_on_pull=False)
    placed(d, [1, 2])
    assert d.on_snapshot(snap(d, 0, t=1.5, running=1, parked_ids=(2,)))
    new_version(d, md)
    cmds = d.tick(2.0)
    assert not any(isinstance(x, (Interrupt, Pull)) for x in cmds) and d.instances[0].draining
    d.on_finished(0, 1)
    assert not any(isinstance(x, Pull) for x in d.tick(3.0))  # the tool waiter is in flight: it drains too
    d.on_finished(0, 2)
    assert Pull(0, 1) in d.tick(4.0)


def test_a_stale_snapshot_race_a_parked_trajectory_that_resumed_loops_back_unasked():
    """The coordinator thought 2 was parked (snapshot a tick old); it had resumed decoding, so the
    instance's own pull interrupted it. Its partial output comes back without a pending Interrupt:
    it queues under its V_traj and resumes on an instance at the new version."""
    c, m = make(n_inst=1, eta=1, pull="greedy")
    placed(c, [1, 2])
    assert c.on_snapshot(snap(c, 0, t=1.5, running=1, parked_ids=(2,)))
    new_version(c, m)
    assert c.tick(2.0)[:2] == [Interrupt(0, (1,), "pull"), Pull(0, 1)]
    loop_back(c, 0, 1, 4)
    loop_back(c, 0, 2, 7)  # the loop-back nobody asked for
    assert c.instance_of(2) == -1 and c.records[2].reserved and c.counters["loop_back"] == 2
    c.on_pull_done(0, 1)
    assert sorted(routes(c.tick(3.0))) == [(1, 0, 0), (2, 0, 0)]  # V_traj 0 kept, on the pulled instance
    assert c.instances[0].trajs[2].kv == 17  # prompt + the 7 tokens of its partial record


def test_the_opposite_race_a_trajectory_thought_running_is_interrupted_as_before():
    c, m = make(n_inst=1, eta=1, pull="greedy")
    placed(c, [1, 2])
    assert c.on_snapshot(snap(c, 0, t=1.5, running=2))  # 2 parked after this snapshot: unknown here
    new_version(c, m)
    assert c.tick(2.0)[:2] == [Interrupt(0, (1, 2), "pull"), Pull(0, 1)]


def test_migration_never_picks_a_tool_waiter_and_counts_only_the_others():
    c, m = make(n_inst=2, eta=1, migration=True, psi=2.0, migration_stop=3, migration_indicator="requests")
    loaded(c, 1, 4)
    busy = c.instances[1]
    for t in list(busy.trajs)[:2]:  # 2 of its 4 wait on a tool: 2 movable < stop 3
        c.sched.transition(t, PARK)
    assert not any(isinstance(x, Interrupt) for x in c.tick(1.0))
    hold(c, 1, 2004)
    hold(c, 1, 2005)
    (mig,) = [x for x in c.tick(2.0) if isinstance(x, Interrupt)]
    assert mig == Interrupt(1, tuple(list(busy.trajs)[2:]), "migrate")


def test_migration_waiting_trigger_skips_tool_waiters():
    c, m = make(n_inst=2, eta=1, migration=True, phi_wait=2)
    loaded(c, 0, 6)
    inst = c.instances[0]
    ids = list(inst.trajs)
    force(inst, waiting=3)
    c.sched.transition(ids[-1], PARK)  # the newest routed one is parked on a tool call
    (mig,) = [x for x in c.tick(1.0) if isinstance(x, Interrupt)]
    assert mig == Interrupt(0, (ids[-2],), "migrate")


def test_parked_ids_cross_a_socket_and_old_senders_decode():
    s = InstanceSnapshot(0, 1, 1, 0, 100, 1000, 12.5, False, 3.0, (7, 8), 5, parked_ids=(8,))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=InstanceSnapshot) == s

    class OldSnapshot(msgspec.Struct, frozen=True, tag="InstanceSnapshot"):
        instance: int
        version: int
        running: int
        waiting: int
        kv_tokens: int
        kv_capacity: int
        tokens_per_s: float
        syncing: bool
        time: float
        traj_ids: tuple[int, ...] = ()
        tokens_generated: int = 0

    old = msgspec.msgpack.encode(OldSnapshot(0, 1, 2, 0, 100, 1000, 12.5, False, 3.0, (7, 8)))
    assert msgspec.msgpack.decode(old, type=InstanceSnapshot).parked_ids == ()


def test_parked_tool_waiters_are_not_decode_load_for_the_waterfall_nor_the_requests_indicator():
    """Instance 0 holds 80 trajectories of which 60 wait on a tool (20 decode), instance 1 holds 70 that all
    decode (past the cost model's compute knee, ~50): the waterfall's marginal gain sees 20 against 70 and
    routes the new work to instance 0 (counting the parked ones, 80 against 70, it went to instance 1), and
    the `requests` indicator (pull, migration) reads 20; KV held by parked ones still counts (kv indicator)."""
    c, m = make(n_inst=2, eta=1, routing="waterfall", mlq=True)
    loaded(c, 0, 80)
    loaded(c, 1, 70)
    parked = tuple(sorted(c.instances[0].trajs))[:60]
    assert c.on_snapshot(snap(c, 0, t=0.5, running=20, parked_ids=parked, kv_tokens=8000))
    assert c.on_snapshot(snap(c, 1, t=0.5, running=70, kv_tokens=7000))
    i0, i1 = c.instances[0], c.instances[1]
    assert (i0.engaged, i0.running, i0.load, i0.indicator("requests")) == (20, 20, 80, 20.0)
    assert i1.indicator("requests") == 70.0 and i0.indicator("kv") == 8000 / COST.kv_capacity
    c.submit([traj(c, 7, 7, None, 10)])
    assert routes(c.tick(1.0)) == [(7, 0, 0)]
