"""One scheduling record per live trajectory (coordinator/record.py): its transitions, its one writer, and a
count of the coordinator's tables keyed by trajectory id (at most the record table and one index)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_coordinator import force, loop_back, make, routes, snap, traj  # noqa: E402

from staleflow.coordinator import Interrupt, Pull  # noqa: E402
from staleflow.coordinator.mlq import MultiLevelQueue  # noqa: E402
from staleflow.coordinator.record import END, INTERRUPT, LOOP_BACK, PARK, ROUTE, SUBMIT, TRUNCATE, UNPARK, Schedule  # noqa: E402
from staleflow.coordinator.stragglers import Stragglers  # noqa: E402


def _schedule(n_inst=2):
    from staleflow.coordinator.instance import InstanceState

    q = MultiLevelQueue()
    insts = {i: InstanceState(i, 10_000) for i in range(n_inst)}
    return Schedule(q, insts), q, insts


def test_sched_record_walks_through_its_states_with_one_writer():
    s, q, insts = _schedule()
    rec = s.transition(7, SUBMIT, group_id=3, traj_version=None, tokens=40)
    assert (rec.state, rec.group_id, rec.arrival, len(q), s.reserved) == ("queued", 3, 1, 1, 0)
    s.transition(8, SUBMIT, group_id=3, tokens=40)
    s.transition(7, ROUTE, instance=1, kv=40, now=1.0)
    assert (rec.state, rec.instance, rec.reserved, s.reserved, len(q)) == ("in_flight", 1, True, 1, 1)
    assert list(insts[1].trajs) == [7] and insts[1].kv_tokens == 40 and insts[1].last_change == 1.0
    s.transition(7, PARK)
    assert rec.state == "parked" and insts[1].engaged == 0 and insts[1].parked == {7}
    s.transition(7, UNPARK)
    s.transition(7, INTERRUPT, now=2.0, reason="migrate")
    assert (rec.state, rec.migrated_at, rec.moved_off, s.interrupting) == ("interrupting", 2.0, 1, 1)
    s.transition(7, LOOP_BACK, now=3.0, traj_version=0, tokens=52)
    assert (rec.state, rec.instance, rec.arrival, s.interrupting, insts[1].load, insts[1].kv_tokens) == (
        "queued",
        -1,
        1,
        0,
        0,
        0,
    )
    assert list(q.ids()) == [7, 8] and q.tagged == {0: 1}  # its level (V_traj 0) before the new ones
    s.transition(7, ROUTE, instance=0, kv=52, now=4.0)
    assert rec.moved_off == -1 and rec.migrated_at == 2.0  # routed again: the move's mark stays, the exclusion goes
    s.transition(8, TRUNCATE)
    assert s.get(8).state == "truncating" and len(q) == 0
    assert s.transition(7, END, now=5.0) is rec and 7 not in s and s.reserved == 0 and insts[0].load == 0


def test_sched_record_refuses_writes_and_impossible_transitions():
    s, q, insts = _schedule()
    rec = s.transition(1, SUBMIT, group_id=1, tokens=10)
    with pytest.raises(AttributeError, match="read-only"):
        rec.instance = 0
    with pytest.raises(AttributeError, match="read-only"):
        insts[0].kv_tokens = 0
    with pytest.raises(TypeError):
        insts[0].trajs[5] = rec  # a read-only mapping
    with pytest.raises(ValueError, match="already live"):
        s.transition(1, SUBMIT, group_id=1, tokens=10)
    with pytest.raises(ValueError, match="not on an instance"):
        s.transition(1, INTERRUPT, reason="migrate")
    with pytest.raises(ValueError, match="already queued"):
        s.transition(1, LOOP_BACK, traj_version=0, tokens=10)
    with pytest.raises(ValueError, match="not queued"):
        s.transition(2, ROUTE, instance=0, kv=1)
    with pytest.raises(ValueError, match="not live"):
        s.transition(2, PARK)
    assert rec.state == "queued" and len(q) == 1 and insts[0].load == 0  # nothing changed


def test_sched_record_the_coordinator_keeps_its_records_in_step_with_the_ledger():
    """Through the coordinator's own events: a route, a tool wait seen in a snapshot, a pull's interrupt, the
    loop-back and the finish; the records, the queue and the instance view agree at each step."""
    c, m = make(n_inst=1, eta=1, pull="greedy")
    c.submit([traj(c, 1, 1, None, 10), traj(c, 2, 2, None, 10)])
    assert routes(c.tick(1.0)) == [(1, 0, 0), (2, 0, 0)]
    assert {t: r.state for t, r in c.records.items()} == {1: "in_flight", 2: "in_flight"}
    assert c.on_snapshot(snap(c, 0, t=1.5, running=1, parked_ids=(2,)))
    assert c.records[2].state == "parked" and c.instances[0].engaged == 1
    m.version = 1
    c.on_new_version(1)
    cmds = c.tick(2.0)
    assert cmds[:2] == [Interrupt(0, (1,), "pull"), Pull(0, 1)]  # the tool waiter stays
    assert c.records[1].state == "interrupting" and c.view.interrupting == 1
    loop_back(c, 0, 1, 5)
    assert c.records[1].state == "queued" and c.view.interrupting == 0 and c.in_flight == 2
    assert c.on_finished(0, 2) and 2 not in c.records and c.instances[0].load == 0


_TABLE_TYPES = (dict, set, frozenset, MappingProxyType)


def _keyed_by(container, ids: set) -> bool:
    keys = list(container.keys() if isinstance(container, Mapping) else container)
    return bool(keys) and all(isinstance(k, int) and k in ids for k in keys)


def _coordinator_tables(root, traj_ids: set, lent=()) -> set[tuple[str, str]]:
    """(class, attribute) of every attribute, on an object of the coordinator package reachable from
    ``root``, holding a set or dict keyed by trajectory id (a read-only mapping counts as the table it shows);
    ``lent``: tables another package owns and lends (the ledger's)."""
    found: dict[int, tuple[str, str]] = {}
    skip = {id(t) for t in lent}
    seen, todo = set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        cls = type(obj)
        if not cls.__module__.startswith("staleflow.coordinator"):
            continue
        names = list(getattr(obj, "__dict__", {}))
        names += [n for k in cls.__mro__ for n in getattr(k, "__slots__", ())]
        for name in names:
            v = getattr(obj, name, None)
            if isinstance(v, MappingProxyType):
                v = gc.get_referents(v)[0]  # the table a read-only mapping shows
            if isinstance(v, _TABLE_TYPES) and id(v) not in skip and _keyed_by(v, traj_ids):
                found.setdefault(id(v), (cls.__name__, name))
            values = v.values() if isinstance(v, Mapping) else v if isinstance(v, (list, tuple, set)) else [v]
            todo.extend(values)
    return set(found.values())


def test_sched_record_the_coordinator_holds_at_most_two_tables_keyed_by_trajectory_id():
    """Every container reachable from a busy coordinator (records, queue, instances, strategies, planners) that
    is keyed by trajectory id: the record table and the one index (what each instance holds). Trajectory,
    group, instance and version ids are drawn from disjoint ranges so a key names one kind."""
    c, m = make(n_inst=3, eta=2, B=8, version=0, migration=True, psi=2.0, migration_stop=1)
    c.stragglers = Stragglers("truncate", 1)  # every planner is reachable from the coordinator
    base, gbase = 10**6, 5 * 10**5
    tids = [base + k for k in range(12)]
    for k, t in enumerate(tids):
        c.submit([traj(c, t, gbase + k, None, 20 + k)])
    c.tick(1.0)
    held = [t for t in tids if c.instance_of(t) >= 0]
    assert held
    force(c.instances[c.instance_of(held[0])], tokens_per_s=10.0)
    i0 = c.instance_of(held[0])
    assert c.on_snapshot(snap(c, i0, t=1.5, running=c.instances[i0].load - 1, parked_ids=(held[0],)))
    c.tick(2.0)  # a migration, perhaps
    for t in held[1:3]:
        if c.records[t].state != "interrupting":
            c.sched.transition(t, INTERRUPT, now=2.5, reason="migrate")
        loop_back(c, c.instance_of(t), t, 4)
    c.tick(3.0)
    tables = _coordinator_tables(c, set(tids), lent=[c.trajs])  # the ledger's table: the controller's, read here
    assert ("Schedule", "records") in tables and ("InstanceState", "_trajs") in tables
    assert len(tables) <= 2, tables
    # the walk finds a table keyed by trajectory ids wherever one hides: the old id sets would count
    c.__dict__["pending_interrupts"] = {tids[0]}
    assert ("Coordinator", "pending_interrupts") in _coordinator_tables(c, set(tids), lent=[c.trajs])
    assert ("Coordinator", "trajs") in _coordinator_tables(c, set(tids))  # (and the lent one, when not excluded)
