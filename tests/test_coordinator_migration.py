"""Coordinator migration on hand-made snapshots: which trajectory moves where, and when not."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_coordinator import force, loaded, loop_back, make, routes, traj  # noqa: E402

from staleflow.coordinator import Interrupt  # noqa: E402


def test_migration_picks_the_largest_ratio():
    c, m = make(n_inst=4, eta=1, version=0, migration=True, psi=2.0, migration_stop=1, migration_indicator="requests")
    loaded(c, 1, 3)
    loaded(c, 2, 7)
    loaded(c, 3, 5)
    cmds = c.tick(1.0)  # instance 0 is starved (TS empty); 7/0 is the largest ratio
    mig = [x for x in cmds if isinstance(x, Interrupt)]
    assert mig == [Interrupt(2, tuple(c.instances[2].trajs), "migrate")]
    assert c.counters["migrations"] == 1


def test_migration_respects_stop_threshold_and_syncing():
    c, m = make(n_inst=2, eta=1, version=0, migration=True, psi=2.0, migration_stop=5)
    loaded(c, 1, 4)  # below the stop threshold
    assert not any(isinstance(x, Interrupt) for x in c.tick(1.0))
    c2, _ = make(n_inst=2, eta=1, version=0, migration=True, psi=2.0, migration_stop=1)
    loaded(c2, 1, 4)
    force(c2.instances[0], syncing=True)
    assert not any(isinstance(x, Interrupt) for x in c2.tick(1.0))


def test_migration_leaves_an_instance_that_is_still_prefilling():
    """No decode progress while it holds running work: it is recomputing the KV of what it was just given
    (loop-backs); moving that work restarts the prefill elsewhere (two such instances used to hand the
    same long loop-backs back and forth forever in the simulator)."""
    c, m = make(n_inst=2, eta=1, version=0, migration=True, psi=2.0, migration_stop=1)
    loaded(c, 1, 4)
    force(c.instances[1], tokens_per_s=0.0)
    assert not any(isinstance(x, Interrupt) for x in c.tick(1.0))
    force(c.instances[1], tokens_per_s=40.0)  # decoding now: the throughput-gap trigger applies again
    assert [x.instance for x in c.tick(2.0) if isinstance(x, Interrupt)] == [1]


def test_a_trajectory_migrates_at_most_once_and_never_back_to_the_instance_it_left():
    c, m = make(n_inst=2, eta=1, B=8, version=0, migration=True, psi=2.0, migration_stop=1)
    placed = {0: [1], 1: [2, 3, 4, 5]}
    for i, tids in placed.items():
        for t in tids:
            c.submit([traj(c, t, 100 + t, None, 50)])
            c.routing.route_one(c.trajs[t], c.records[t], c.instances[i], 0, 0.0, [])
        force(c.instances[i], tokens_per_s=10.0)
    mig = [x for x in c.tick(10.0) if isinstance(x, Interrupt)]  # 4 vs 1 requests: ratio 4 > psi
    assert mig == [Interrupt(1, (2, 3, 4, 5), "migrate")]
    for t in (2, 3, 4, 5):
        loop_back(c, 1, t, 30)
    # instance 1 is now empty, the best marginal gain: without the rule they would all go back there
    assert {(t, i) for t, i, _ in routes(c.tick(11.0))} == {(2, 0), (3, 0), (4, 0), (5, 0)}
    force(c.instances[0], tokens_per_s=50.0)
    # instance 1 is starved and 0 holds 5, but 4 of them moved once already: nothing moves again
    assert not any(isinstance(x, Interrupt) for x in c.tick(30.0))
    assert c.counters["migrations"] == 1


def test_migration_waiting_queue_trigger():
    c, m = make(n_inst=2, eta=1, version=0, migration=True, phi_wait=2)
    loaded(c, 0, 6)
    force(c.instances[0], waiting=5)
    mig = [x for x in c.tick(1.0) if isinstance(x, Interrupt)]
    assert mig == [Interrupt(0, tuple(list(c.instances[0].trajs)[-3:]), "migrate")]


# ---- redundancy, closed windows, stragglers ----------------------------------------------------
