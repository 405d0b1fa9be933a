"""Unit tests of the staleness manager: the digest's worked example, groups, redundancy, errors."""

import json

import pytest

from staleflow.protocol import BufferState, EntryState, ProtocolError, StalenessManager, StalenessSpec


def advance_to(m: StalenessManager, version: int, gid_prefix="warm"):
    """Fill and consume buffers until m.version == version (one-member groups at the newest V)."""
    i = 0
    while m.version < version:
        gid = f"{gid_prefix}{i}"
        for k in range(m.group_size):
            m.reserve(f"{gid}.{k}", gid, m.version)
            m.complete(f"{gid}.{k}")
        m.occupy(gid)
        if m.ready_version() is not None:
            m.consume(m.version)
        i += 1


def test_worked_example_reserve_latest_occupy_earliest():
    # eta=1; trajectories 1-6 get V_traj = V1 -> reservations go to buffer V2;
    # trajectory 1 finishes first and occupies the earliest free slot, in V1.
    m = StalenessManager(StalenessSpec(eta=1, batch_size=6))
    advance_to(m, 1)
    assert m.version == 1
    for t in range(1, 7):
        assert m.reserve(t, t, 1) == 2
    assert m.buffer_state(2) is BufferState.STUCK  # all 6 entries RESERVED, none EMPTY
    assert m.buffer_state(1) is BufferState.WAITING
    m.complete(1)
    assert m.occupy(1) == 1
    assert m.buffer_entries(1)[EntryState.OCCUPIED] == 1
    assert m.buffer_entries(2) == {EntryState.EMPTY: 1, EntryState.RESERVED: 5, EntryState.OCCUPIED: 0}
    # V1 fills first and becomes Ready; V2 keeps room for the stragglers
    for t in range(2, 7):
        m.complete(t)
        assert m.occupy(t) == 1
    assert m.ready_version() == 1
    assert m.buffer_state(2) is BufferState.WAITING
    assert m.consume(1) == [1, 2, 3, 4, 5, 6]
    assert all(tv == 1 and bv == 1 for _, tv, bv in m.consumption_log()[-6:])
    m.validate()


def test_occupy_never_later_than_reservation_and_within_window():
    """Without the occupy exchange (the ablation): early finishers cannot enter an earlier buffer
    whose entries are all reserved (tests/test_occupy_exchange.py has the exchange)."""
    m = StalenessManager(StalenessSpec(eta=2, batch_size=2), exchange=False)
    assert [m.reserve(i, i, 0) for i in range(6)] == [2, 2, 1, 1, 0, 0]
    assert not m.can_admit(0)
    with pytest.raises(ProtocolError, match="not admissible"):
        m.reserve(99, 99, 0)
    for i in (0, 1, 2, 3):
        m.complete(i)
    # greedy earliest: 0 and 1 fill buffer 0 ... but buffer 0 is full of reservations (4, 5)
    assert m.occupy(0) == 2 and m.occupy(1) == 2
    assert m.occupy(2) == 1 and m.occupy(3) == 1
    assert m.ready_version() is None
    m.complete(4)
    m.complete(5)
    assert m.occupy(5) == 0 and m.occupy(4) == 0
    assert m.consume(0) == [5, 4]
    assert m.consume(1) == [2, 3]
    assert m.consume(2) == [0, 1]
    assert [(g, t, b) for g, t, b in m.consumption_log()] == [
        (5, 0, 0),
        (4, 0, 0),
        (2, 0, 1),
        (3, 0, 1),
        (0, 0, 2),
        (1, 0, 2),
    ]


def test_group_version_is_min_and_group_redundancy_aborts_surplus():
    m = StalenessManager(StalenessSpec(eta=1, batch_size=1, group_size=2, group_capacity=3))
    advance_to(m, 1)
    assert m.reserve("a", "g", 1) == 2
    assert not m.can_admit(0, group_id="g")
    with pytest.raises(ProtocolError, match="cannot join group 'g' reserved in buffer 2"):
        m.reserve("old", "g", 0)  # an older member would break its own bound in buffer 2
    assert m.reserve("b", "g", 1) == 2 and m.reserve("c", "g", 1) == 2
    with pytest.raises(ProtocolError, match="group_capacity=3"):
        m.reserve("d", "g", 1)
    assert m.complete("b") == []
    with pytest.raises(ProtocolError, match="1 of group_size=2"):
        m.occupy("g")
    assert sorted(m.complete("c")) == ["a"]  # N reached: the surplus member is aborted
    with pytest.raises(ProtocolError, match="unknown or aborted"):
        m.complete("a")
    assert m.occupy("g") == 1
    assert m.consume(1) == ["g"]
    assert m.stats()["trajs_aborted_by_reason"] == {"group_redundancy": 1}


def test_group_min_version_shrinks_window():
    m = StalenessManager(StalenessSpec(eta=2, batch_size=1, group_size=2))
    advance_to(m, 2)
    assert m.reserve("x", "g", 1) == 3
    assert m.reserve("y", "g", 2) == 3  # buffer 3 <= 2 + eta
    assert m.group_info("g")["traj_version"] == 1
    m.complete("x")
    m.complete("y")
    assert m.occupy("g") == 2
    assert m.consumption_log() and m.consume(2) == ["g"]
    assert m.consumption_log()[-1] == ("g", 1, 2)


def test_member_crash_aborts_group_when_n_unreachable():
    m = StalenessManager(StalenessSpec(eta=1, batch_size=2, group_size=2, group_capacity=3))
    m.reserve(0, "g", 0)
    m.reserve(1, "g", 0)
    m.reserve(2, "g", 0)
    assert m.abort(0, "crash") == []  # 2 members left, N=2 still reachable
    assert m.abort(1, "crash") == ["g"]
    assert m.aborted_groups() == {"g": "crash"}
    assert m.buffer_entries(1)[EntryState.RESERVED] == 0
    with pytest.raises(ProtocolError, match="already aborted: crash"):
        m.occupy("g")
    with pytest.raises(ProtocolError, match="use a new group id"):
        m.reserve(5, "g", 0)
    assert m.stats()["groups_aborted_by_reason"] == {"crash": 1}
    m.validate()


def test_batch_redundancy_moves_then_closes_surplus():
    # B=1, B'=2, eta=1: buffers 0 and 1 take two reservations each.
    m = StalenessManager(StalenessSpec(eta=1, batch_size=1, capacity=2))
    assert [m.reserve(i, i, 0) for i in range(4)] == [1, 1, 0, 0]
    m.complete(2)
    assert m.occupy(2) == 0  # buffer 0 Ready; reservation of group 3 cannot move (buffer 1 full)
    assert m.closed_windows() == [3]
    assert m.group_info(3)["state"] == "closed"
    with pytest.raises(ProtocolError, match="window closed"):
        m.complete(3) or m.occupy(3)
    assert m.abort_group(3, "closed_window") == []
    m.complete(0)
    assert m.occupy(0) == 1  # buffer 1 Ready: its other reservation (group 1) has no room left
    assert m.closed_windows() == [1]
    assert m.closed_version == 0 and not m.can_admit(0)
    assert m.abort_group(1, "closed_window") == [1]
    assert m.consume(0) == [2] and m.consume(1) == [0]
    m.validate()


def test_surplus_reservation_moves_to_later_buffer_with_room():
    m = StalenessManager(StalenessSpec(eta=1, batch_size=1, capacity=3))
    assert [m.reserve(i, i, 0) for i in range(4)] == [1, 1, 1, 0]
    m.complete(3)
    assert m.occupy(3) == 0  # buffer 0 Ready: nothing else reserved there
    m.complete(0)
    assert m.occupy(0) == 1  # buffer 1 Ready: groups 1, 2 reserved there, window [0, 1] is closed
    assert m.closed_windows() == [1, 2]
    m2 = StalenessManager(StalenessSpec(eta=2, batch_size=1, capacity=2))
    assert [m2.reserve(i, i, 0) for i in range(3)] == [2, 2, 1]
    m2.complete(0)
    assert m2.occupy(0) == 0  # buffer 0 Ready (nothing reserved there)
    m2.complete(1)
    assert m2.occupy(1) == 1  # buffer 1 Ready: group 2 moves to buffer 2 (one EMPTY entry)
    assert m2.closed_windows() == [] and m2.group_info(2)["buffer_version"] == 2
    m2.validate()


def test_stuck_stragglers():
    m = StalenessManager(StalenessSpec(eta=0, batch_size=3))
    for i in range(3):
        m.reserve(i, i, 0)
    assert m.buffer_state(0) is BufferState.STUCK
    assert m.stuck_stragglers(1) == []
    m.complete(0)
    m.occupy(0)
    assert m.stuck_stragglers(1) == [] and m.stuck_stragglers(2) == [1, 2]
    m.complete(1)
    m.occupy(1)
    assert m.stuck_stragglers(1) == [2]
    assert m.abort_group(2, "straggler") == [2]
    assert m.buffer_state(0) is BufferState.WAITING and m.stuck_stragglers(1) == []


def test_state_dict_round_trip_is_json_and_exact():
    m = StalenessManager(StalenessSpec(eta=2, batch_size=2, capacity=3, group_size=2, group_capacity=3))
    for g in range(5):
        for k in range(3):
            m.reserve(f"t{g}.{k}", g, 0)
    m.complete("t0.0")
    m.complete("t0.1")
    m.occupy(0)
    m.abort("t1.0", "crash")
    m.abort_group(2, "filter")
    sd = m.state_dict()
    m2 = StalenessManager.from_state_dict(json.loads(json.dumps(sd)))
    assert m2.state_dict() == sd and m2.stats() == m.stats()
    assert m2.reserve("new", "new", 0) == m.reserve("new", "new", 0)
    with pytest.raises(ProtocolError, match="format"):
        StalenessManager.from_state_dict({"format": "other"})
    bad = json.loads(json.dumps(sd))
    bad["buffers"][0]["reserved"].append(99)
    with pytest.raises(ProtocolError, match="inconsistent"):
        StalenessManager.from_state_dict(bad)
    bad = json.loads(json.dumps(sd))
    del bad["groups"][0]["live"]
    with pytest.raises(ProtocolError, match="malformed .*KeyError"):
        StalenessManager.from_state_dict(bad)
    bad = json.loads(json.dumps(sd))
    bad["consumed"].append(["ghost", 0, 0])
    with pytest.raises(ProtocolError, match="inconsistent"):
        StalenessManager.from_state_dict(bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(eta=-1, batch_size=1), "eta=-1"),
        (dict(eta=1, batch_size=0), "batch_size=0"),
        (dict(eta=1, batch_size=4, capacity=3), "capacity=3"),
        (dict(eta=1, batch_size=4, group_size=2, group_capacity=1), "group_capacity=1"),
        (dict(eta=1.5, batch_size=4), "eta=1.5"),
        (dict(eta="1", batch_size=4), "eta=.1."),
        (dict(eta=True, batch_size=4), "eta=True"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ProtocolError, match=match):
        StalenessManager(StalenessSpec(**kwargs))


def test_bad_operations_raise_and_change_nothing():
    m = StalenessManager(StalenessSpec(eta=1, batch_size=2))
    m.reserve("a", "a", 0)
    before = m.state_dict()
    cases = [
        (lambda: m.reserve("b", "b", 1), "does not exist yet"),
        (lambda: m.reserve("b", "b", -1), "must be an int >= 0"),
        (lambda: m.reserve("a", "z", 0), "already reserved"),
        (lambda: m.reserve(("t",), "z", 0), "must be an int or str"),
        (lambda: m.complete("nope"), "unknown"),
        (lambda: m.occupy("nope"), "unknown group id"),
        (lambda: m.occupy("a"), "0 of group_size=1"),
        (lambda: m.consume(1), "out of order"),
        (lambda: m.consume(0), "not Ready"),
        (lambda: m.abort("nope", "crash"), "unknown"),
        (lambda: m.abort("a", ""), "non-empty str"),
        (lambda: m.abort_group("nope", "x"), "unknown group id"),
        (lambda: m.stuck_stragglers(0), "threshold 0"),
        (lambda: m.buffer_state(-1), "already consumed"),
    ]
    for call, match in cases:
        with pytest.raises(ProtocolError, match=match):
            call()
        assert m.state_dict() == before, match
    m.complete("a")
    m.occupy("a")
    with pytest.raises(ProtocolError, match="already occupies"):
        m.occupy("a")
    with pytest.raises(ProtocolError, match="already occupies"):
        m.abort_group("a", "x")
    with pytest.raises(ProtocolError, match="already complete"):
        m.complete("a")


def test_start_at_version_for_resume():
    m = StalenessManager(StalenessSpec(eta=1, batch_size=1, version=5))
    assert m.version == 5 and m.closed_version == 4
    assert not m.can_admit(4) and m.can_admit(5)
    assert m.reserve("t", "g", 5) == 6
    m.complete("t")
    assert m.occupy("g") == 5 and m.consume(5) == ["g"]
    with pytest.raises(ProtocolError, match="version=-1"):
        StalenessManager(StalenessSpec(eta=1, batch_size=1, version=-1))


def test_every_protocol_is_built_from_one_staleness_spec():
    """The six settings (eta, B, B', N, N', start version) travel as one validated StalenessSpec."""
    from staleflow.modes import MODES, build_protocol

    spec = StalenessSpec(eta=2, batch_size=3, group_size=2, version=4)
    assert (spec.capacity, spec.group_capacity) == (3, 2)  # None: B and N
    for name in MODES:  # every mode's protocol (each registered mode builds its own)
        m = build_protocol(name, spec)
        assert m.spec is spec and (m.eta, m.batch_size, m.group_capacity, m.version) == (2, 3, 2, 4)
        with pytest.raises(ProtocolError, match="takes a StalenessSpec"):
            type(m)(2, 3)
    with pytest.raises(Exception, match="frozen|cannot assign"):
        spec.eta = 1
