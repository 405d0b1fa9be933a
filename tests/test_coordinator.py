"""Coordinator strategies on hand-made snapshots: routing, pull, migration, modes, redundancy."""

from __future__ import annotations

import pytest

from staleflow.config import CoordinatorConfig
from staleflow.controller.ledger import Traj
from staleflow.coordinator import (
    Abort,
    Coordinator,
    CostModel,
    InstanceSnapshot,
    Interrupt,
    Pull,
    Route,
    register_routing,
)
from staleflow.coordinator.record import END, RESERVE, ROUTE, SUBMIT, TRUNCATE
from staleflow.coordinator.strategies import ROUTING
from staleflow.modes import apply_mode, mode_of
from staleflow.protocol import StalenessSpec
from staleflow.protocol.staleness import StalenessManager

COST = CostModel(k1=1e-7, k2=0.02, k3=2e-4, b3=0.01, k4=1e-3, kv_capacity=100_000, name="test")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(n_inst=2, eta=2, B=4, N=1, Np=None, mode="staleflow", version=0, clock=None, **cfg):
    cfg.setdefault("migration", False)
    m = StalenessManager(StalenessSpec(eta, B, group_size=N, group_capacity=Np))
    for v in range(version):  # advance the manager so versions up to `version` exist
        m.version = v + 1
    ccfg, _ = apply_mode(mode, CoordinatorConfig(**cfg))
    c = Coordinator(ccfg, COST, m, range(n_inst), trajs={}, version=version, clock=clock or Clock())
    c.on_new_version(version)
    return c, m


def traj(c, tid, gid, V, prompt_len, n_tokens=0):
    """Trajectory `tid` in the table the coordinator looks trajectories up in (the ledger's, as
    Ledger.new_group makes it; V set: a tagged one); returns its id for ``submit``."""
    c.trajs[tid] = Traj(tid, gid, 0, traj_version=V, n_tokens=n_tokens, prompt_len=prompt_len)
    return tid


def loop_back(c, instance, tid, n_tokens):
    """What the loop does with a partial Finished: update the record, then report the loop-back."""
    c.trajs[tid].n_tokens, c.trajs[tid].origin = n_tokens, instance
    c.on_interrupted(instance, [tid])


def snap(c, i, t=1.0, **kw):
    s = c.instances[i]
    d = dict(
        instance=i,
        version=s.version,
        running=s.load,
        waiting=0,
        kv_tokens=s.kv_tokens,
        kv_capacity=COST.kv_capacity,
        tokens_per_s=0.0,
        syncing=s.syncing,
        time=t,
    )
    d.update(kw)
    return InstanceSnapshot(**d)


def force(inst, **fields):
    """Test set-up only: write an instance's speculative fields as a snapshot or a finished pull would (an
    InstanceState is read-only to everything but the coordinator)."""
    for k, v in fields.items():
        object.__setattr__(inst, k, v)


def set_version(c, i, v):
    force(c.instances[i], version=v, target_version=v)


def routes(cmds):
    return [(r.traj_id, r.instance, r.traj_version) for r in cmds if isinstance(r, Route)]


def reserve_as_loopback(c, m, tid, gid, V, generated=10):
    """A trajectory that was routed at V, then interrupted: it is back in the TS with its tag."""
    m.reserve(tid, gid, V)
    c.group_tag[gid] = V
    c.submit([traj(c, tid, gid, V, 100, generated)])
    c.sched.transition(tid, RESERVE)


def hold(c, i, tid, tokens=10, V=0):
    """Put trajectory `tid` (a one-member group) on instance i through the transition function, as a route
    would, without touching the batch protocol (the instance's KV and last change stay as they are)."""
    inst = c.instances[i]
    traj(c, tid, 10**6 + tid, V, tokens)
    c.sched.transition(tid, SUBMIT, group_id=10**6 + tid, traj_version=V, tokens=tokens)
    c.sched.transition(tid, ROUTE, instance=i, kv=0, now=inst.last_change)


def loaded(c, i, n, t=0.5):
    for k in range(n):
        hold(c, i, 1000 * (i + 1) + k)
    force(c.instances[i], tokens_per_s=10.0 * n)


# ---- cost model --------------------------------------------------------------------------------
def test_cost_model_formula_and_closed_form_steps():
    n, kv = 8, 5000
    assert COST.step_time(n, kv) == pytest.approx(1e-7 * kv + max(0.02, 2e-4 * n + 0.01) + 1e-3)
    assert COST.throughput(n, kv) == pytest.approx(n / COST.step_time(n, kv))
    assert COST.ideal_gain(300) == pytest.approx(1 / COST.step_time(1, 300))
    ref = sum(COST.step_time(n, kv + n * j) for j in range(50))  # KV grows by n per step
    assert COST.steps_time(n, kv, 50) == pytest.approx(ref, rel=1e-12)
    k = COST.steps_within(n, kv, ref)
    assert k in (49, 50) and COST.steps_time(n, kv, k) <= ref + 1e-12 < COST.steps_time(n, kv, k + 1)


# ---- routing -----------------------------------------------------------------------------------
def test_older_level_routed_first_and_strict_priority():
    c, m = make(n_inst=1, eta=2, version=2, max_concurrent=1)
    set_version(c, 0, 2)
    reserve_as_loopback(c, m, 20, 2, V=2, generated=500)  # newer level, more tokens
    reserve_as_loopback(c, m, 10, 1, V=1, generated=5)
    c.submit([traj(c, 30, 3, None, 100)])
    assert routes(c.tick(1.0)) == [(10, 0, 1)]  # the oldest level wins despite fewer tokens
    c.on_finished(0, 10)
    assert routes(c.tick(2.0)) == [(20, 0, 2)]  # then the next level, and new trajectories last
    c.on_finished(0, 20)
    assert routes(c.tick(3.0)) == [(30, 0, 2)]


def test_longest_first_within_a_level():
    c, m = make(n_inst=1, eta=2, version=1, max_concurrent=1)
    set_version(c, 0, 1)
    reserve_as_loopback(c, m, 1, 1, V=1, generated=10)
    reserve_as_loopback(c, m, 2, 2, V=1, generated=900)
    assert routes(c.tick(1.0)) == [(2, 0, 1)]


def test_never_routed_to_an_instance_older_than_traj_version():
    c, m = make(n_inst=2, eta=2, version=2, max_concurrent=1, pull="idle")  # no pull while work is in flight
    set_version(c, 0, 0)
    set_version(c, 1, 2)
    reserve_as_loopback(c, m, 1, 1, V=2)
    reserve_as_loopback(c, m, 2, 2, V=2)
    assert routes(c.tick(1.0)) == [(1, 1, 2)]  # instance 0 (version 0) is idle but too old
    assert routes(c.tick(2.0)) == []  # instance 1 is at its cap; 2 waits instead of going to 0


def test_waterfall_falls_to_the_next_tier():
    c, m = make(n_inst=2, eta=2, version=1, mu=0.2, pull="idle")
    set_version(c, 0, 0)  # tier 0 (older version first)
    set_version(c, 1, 1)  # tier 1
    reserve_as_loopback(c, m, 1, 1, V=0)
    assert routes(c.tick(1.0)) == [(1, 0, 0)]  # normally tier 0 takes it
    reserve_as_loopback(c, m, 2, 2, V=0)
    assert c.on_snapshot(snap(c, 0, t=2.0, running=0, waiting=1))  # instance 0 has an engine queue
    assert routes(c.tick(2.0)) == [(2, 1, 0)]  # so the waterfall falls to tier 1


def test_waterfall_rejects_a_gain_below_mu_times_ideal():
    c, m = make(n_inst=1, eta=2, version=0, mu=0.9)
    # a full instance: the marginal gain of one more trajectory is far below 0.9x an empty one
    c.on_snapshot(snap(c, 0, t=0.5))
    for t in range(50):
        hold(c, 0, 1000 + t, tokens=0)
    force(c.instances[0], kv_tokens=95_000)
    c.submit([traj(c, 1, 1, None, 100)])
    assert routes(c.tick(1.0)) == []
    assert len(c.queue) == 1 and m.stats()["groups_in_flight"] == 0  # nothing reserved for it


def test_dynamic_tag_reserves_at_the_instance_post_sync_version():
    c, m = make(n_inst=1, eta=1, B=2, N=2, version=3)
    set_version(c, 0, 3)
    c.submit([traj(c, 1, 7, None, 50), traj(c, 2, 7, None, 50)])
    assert routes(c.tick(1.0)) == [(1, 0, 3), (2, 0, 3)]
    info = m.group_info(7)
    assert info["traj_version"] == 3 and sorted(info["live"]) == [1, 2] and info["buffer_version"] == 4


def test_speculative_state_and_stale_snapshots():
    clock = Clock()
    c, m = make(n_inst=1, version=0, clock=clock)
    c.submit([traj(c, 1, 1, None, 100)])
    clock.t = 1.0
    c.tick(1.0)
    inst = c.instances[0]
    assert inst.load == 1 and inst.kv_tokens == 100  # updated at once by its own Route
    assert not c.on_snapshot(snap(c, 0, t=0.9, running=0))  # taken before the route: dropped
    assert not c.on_snapshot(snap(c, 0, t=1.1, running=2))  # disagrees with the local count
    assert c.on_snapshot(snap(c, 0, t=1.1, running=1, kv_tokens=180))
    assert inst.kv_tokens == 180 and inst.snapshots_dropped == 2


def test_routing_pauses_until_interrupted_work_loops_back():
    c, m = make(n_inst=2, eta=1, version=0, pull="greedy")
    c.submit([traj(c, 1, 1, None, 100)])
    assert routes(c.tick(1.0)) == [(1, 0, 0)]
    m.version = 1  # the trainer consumed buffer 0 and published version 1
    c.on_new_version(1)
    c.submit([traj(c, 2, 2, None, 100)])
    cmds = c.tick(2.0)
    assert Interrupt(0, (1,), "pull") in cmds and Pull(0, 1) in cmds and Pull(1, 1) in cmds
    assert routes(cmds) == []  # paused: trajectory 1 has not looped back yet
    loop_back(c, 0, 1, 40)
    got = routes(c.tick(3.0))
    assert (1, 0, 0) in got or (1, 1, 0) in got  # resumes with its V_traj 0 on a post-sync instance
    assert c.instances[c.instance_of(1)].trajs[1].kv == 140  # the record's prompt + generated tokens


def test_the_coordinator_reads_trajectories_from_its_table_only():
    """Ids in, facts looked up: an id the table lacks, or a loop-back whose record was not updated
    (its origin is not the instance it came back from), is refused with what to do."""
    c, m = make(n_inst=2)
    with pytest.raises(ValueError, match="trajectory 5 is not in the trajectory table"):
        c.submit([5])
    c.submit([traj(c, 1, 1, None, 100)])
    ((_, inst, _),) = routes(c.tick(1.0))
    with pytest.raises(ValueError, match=f"came back from instance {inst}, its record says origin -1"):
        c.on_interrupted(inst, [1])
    c.trajs[1].prompt_len = 7  # the record changed (as only the loop may): the coordinator sees it
    loop_back(c, inst, 1, 3)
    assert list(c.queue.ids()) == [1] and c.queue.tagged == {0: 1}  # under the group's V_traj 0
    got = routes(c.tick(2.0))
    assert got and c.instances[got[0][1]].trajs[1].kv == 10


# ---- pull --------------------------------------------------------------------------------------
def test_status_pull_waits_for_queue_and_routable_work():
    c, m = make(n_inst=1, eta=1, version=0, pull="status", pull_indicator="requests", pull_threshold=5)
    m.version = 1
    c.on_new_version(1)
    loaded(c, 0, 2)
    assert c.on_snapshot(snap(c, 0, t=0.5, running=0, waiting=2))
    assert not any(isinstance(x, Pull) for x in c.tick(1.0))  # the engine still has a queue
    for t in list(c.instances[0].trajs):  # they finished
        c.sched.transition(t, END, now=1.0)
    assert c.on_snapshot(snap(c, 0, t=1.5, running=0, waiting=0))
    reserve_as_loopback(c, m, 5, 5, V=0)  # work still routable at version 0
    cmds = c.tick(2.0)
    assert not any(isinstance(x, Pull) for x in cmds) and routes(cmds) == [(5, 0, 0)]
    c.on_finished(0, 5)
    # nothing routable at version 0 any more (window [0, 1] of new work: version 0 is closed once
    # buffer 0 is consumed... here B=4 buffers still have room, so close admission by filling them)
    for g in range(100, 108):
        if m.can_admit(0):
            m.reserve(g, g, 0)
    assert not m.can_admit(0)
    assert Pull(0, 1) in c.tick(3.0)


def test_greedy_pull_interrupts_everything_at_once():
    c, m = make(n_inst=1, eta=1, version=0, pull="greedy")
    c.submit([traj(c, 1, 1, None, 10), traj(c, 2, 2, None, 10)])
    c.tick(1.0)
    m.version = 1
    c.on_new_version(1)
    cmds = c.tick(2.0)
    assert cmds[:2] == [Interrupt(0, (1, 2), "pull"), Pull(0, 1)]


# ---- migration ---------------------------------------------------------------------------------
def test_group_redundancy_aborts_the_surplus():
    c, m = make(n_inst=1, eta=1, B=1, N=2, Np=3, version=0)
    c.submit([traj(c, t, 9, None, 10) for t in (1, 2, 3)])
    assert len(routes(c.tick(1.0))) == 3
    assert c.on_finished(0, 1) is True
    assert c.on_finished(0, 2) is True  # N of N' done: the third member is surplus
    assert c.on_finished(0, 3) is False  # its finish crossed the Abort: it does not count
    assert Abort(0, (3,), "surplus") in c.tick(2.0)
    assert c.on_rewarded(9) == 0 and m.ready_version() == 0


def test_straggler_truncate_and_abort():
    for mode in ("truncate", "abort"):
        m = StalenessManager(StalenessSpec(0, 2, group_size=1))
        c = Coordinator(
            CoordinatorConfig(migration=False),
            COST,
            m,
            [0],
            trajs={},
            straggler=mode,
            straggler_threshold=1,
            clock=Clock(),
        )
        c.submit([traj(c, 1, 1, None, 10), traj(c, 2, 2, None, 10)])
        c.tick(1.0)
        c.on_finished(0, 1)
        c.on_rewarded(1)  # buffer 0: one OCCUPIED, one RESERVED -> Stuck with 1 straggler
        cmds = c.tick(2.0)
        if mode == "truncate":
            assert Interrupt(0, (2,), "truncate") in cmds
        else:
            assert Abort(0, (2,), "straggler") in cmds and Abort(-1, (), "straggler", True, 2) in cmds


# ---- modes and registry ------------------------------------------------------------------------
def test_modes_are_overrides_of_one_config():
    cfg = CoordinatorConfig()
    c, _ = apply_mode("staleflow-simple-strategies", cfg)  # what "areal" meant before issue 15
    assert (c.routing, c.pull, c.migration, c.mlq) == ("least-loaded", "greedy", False, False)
    c, _ = apply_mode("areal", cfg)
    assert (c.routing, c.pull, c.migration, c.mlq, c.interrupt_on_pull) == (
        "round-robin",
        "pause-all",
        False,
        False,
        True,
    )
    c, _ = apply_mode("one-step-off", cfg)  # alias of verl-one-step-off
    assert c.barrier and c.pull == "idle" and not c.interrupt_on_pull and c.routing == "round-robin"
    assert mode_of("sync").staleness["eta"] == 0 == mode_of("verl-sync").staleness["eta"]
    assert apply_mode("staleflow", cfg)[0] == cfg
    with pytest.raises(ValueError, match="--mode='verl-async': choose one of"):
        mode_of("verl-async")
    from staleflow.config import RunConfig, StalenessConfig, resolve

    run = resolve(RunConfig(mode="sync", staleness=StalenessConfig(eta=3)))
    assert run.staleness.eta == 0 and run.coordinator.barrier and resolve(run) == run


def test_registry_lets_a_fork_add_a_router():
    @register_routing("last-instance")
    class Last:
        def __init__(self, cfg, cost_model):
            pass

        def choose(self, traj, traj_version, candidates, ctx):
            return max(candidates, key=lambda i: i.instance)

    try:
        c, _ = make(n_inst=3, routing="last-instance")
        c.submit([traj(c, 1, 1, None, 10)])
        assert routes(c.tick(1.0)) == [(1, 2, 0)]
    finally:
        del ROUTING["last-instance"]
    with pytest.raises(ValueError, match="registered"):
        make(routing="nope")


def test_round_robin_and_leastloaded():
    c, _ = make(n_inst=3, routing="round-robin")
    c.submit([traj(c, t, t, None, 10) for t in range(4)])
    assert [r[1] for r in routes(c.tick(1.0))] == [0, 1, 2, 0]
    c, _ = make(n_inst=2, routing="least-loaded")
    loaded(c, 0, 2)
    c.submit([traj(c, 1, 1, None, 10)])
    assert routes(c.tick(1.0)) == [(1, 1, 0)]


def test_commands_and_snapshots_cross_a_socket_as_msgpack():
    import msgspec

    from staleflow.coordinator.types import Command

    cmds = [Route(1, 2, 3), Pull(0, 4), Interrupt(1, (5, 6), "pull"), Abort(-1, (), "straggler", True, 9)]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cmds), type=list[Command]) == cmds
    s = InstanceSnapshot(0, 1, 2, 0, 100, 1000, 12.5, False, 3.0, (7, 8))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=InstanceSnapshot) == s


def test_waterfall_sends_a_fresh_group_to_the_newest_version_first():
    """PSRL's dynamic-tag rule: the first member of a fresh group tries the newest instances first (its
    deadline V_traj + eta is as late as possible); tagged work keeps the oldest-first tiers."""
    c, m = make(n_inst=2, eta=2, version=1, mu=0.2, pull="idle")
    set_version(c, 0, 0)
    set_version(c, 1, 1)
    traj(c, 999, 999, 0, 10)  # something in flight: the idle policy does not pull instance 0 meanwhile
    for event in (SUBMIT, RESERVE, TRUNCATE):  # reserved, out of the queue, on no instance
        c.sched.transition(999, event, group_id=999, traj_version=0, tokens=10)
    c.submit([traj(c, 1, 1, None, 100)])
    assert routes(c.tick(1.0)) == [(1, 1, 1)]
    reserve_as_loopback(c, m, 2, 2, V=0)
    assert routes(c.tick(2.0)) == [(2, 0, 0)]


def test_waterfall_budget_counts_the_kv_a_request_grows_into():
    """PSRL's throughput_optimal_with_budget: a request is prompt + generated rounded up to the budget
    (1024), an instance its KV + one budget per held request; "KV fits" uses those."""
    from staleflow.coordinator.strategies import WaterfallBudget

    r = WaterfallBudget(CoordinatorConfig(), COST)
    assert r.request_tokens(Traj(1, 1, 0, prompt_len=100)) == 100 + 1024
    assert r.request_tokens(Traj(1, 1, 0, traj_version=0, n_tokens=1024, prompt_len=100)) == 100 + 2048
    for routing, expect in (("waterfall", [(1, 0, 0)]), ("waterfall-budget", [])):
        c, _ = make(n_inst=1, eta=2, version=0, mu=0.0, routing=routing)
        c.on_snapshot(snap(c, 0, t=0.5))
        force(c.instances[0], kv_tokens=99_000)  # room for the prompt now, not for its next 1024 tokens
        c.submit([traj(c, 1, 1, None, 100)])
        assert routes(c.tick(1.0)) == expect, routing


def test_a_coordinator_refuses_a_protocol_that_is_not_its_modes():
    """One builder gives a mode its protocol (controller/build.py); the coordinator never swaps one in."""
    from staleflow.config import StalenessConfig
    from staleflow.modes import protocol_for
    from staleflow.modes.areal import AReaLBuffer

    with pytest.raises(
        ValueError, match="mode 'areal' runs protocol AReaLBuffer, but the coordinator was given a StalenessManager"
    ):
        Coordinator(CoordinatorConfig(), COST, StalenessManager(StalenessSpec(1, 2)), range(2), trajs={}, label="areal")
    with pytest.raises(ValueError, match="without the occupy exchange"):
        Coordinator(
            CoordinatorConfig(),
            COST,
            StalenessManager(StalenessSpec(1, 2)),
            range(2),
            trajs={},
            label="staleflow-no-exchange",
        )
    stale = StalenessConfig(eta=1, batch_size=2, group_size=1)
    assert isinstance(
        Coordinator(CoordinatorConfig(), COST, protocol_for("areal", stale), range(2), trajs={}, label="areal").manager,
        AReaLBuffer,
    )
    assert (
        Coordinator(
            CoordinatorConfig(), COST, StalenessManager(StalenessSpec(1, 2)), range(2), trajs={}, label="my-fork"
        ).manager.eta
        == 1
    )
