"""Each baseline's rule, pinned: verl-sync, verl-one-step-off, verl-fully-async, areal (docs/baselines.md).

The peers' count-based protocols (modes/areal.py, modes/verl.py) against hand-worked cases, and
the weight-sync rules (batch barrier, pause-all) through the shared controller loop with a scripted
backend, then every baseline end to end in the simulator (same loop, same coordinator).
"""

from __future__ import annotations

import pytest
from controller_fakes import Prompts, ScriptedBackend

from staleflow.config import CoordinatorConfig, StalenessConfig
from staleflow.controller import Finished, Published, PullDone, TrainDone
from staleflow.controller.build import build_loop
from staleflow.coordinator import CostModel, Interrupt, Pull, Route
from staleflow.modes import apply_mode, build_protocol, mode_of, peers
from staleflow.modes.areal import AReaLBuffer
from staleflow.modes.verl import VerlAsyncBuffer
from staleflow.protocol import ProtocolError, StalenessManager, StalenessSpec

BASELINES = tuple(m.name for m in peers())

COST = CostModel(k1=1e-7, k2=0.02, k3=2e-4, b3=0.01, k4=1e-3, kv_capacity=100_000, name="test")


def start(m, gid, V=0):
    m.reserve(f"{gid}.0", gid, V)


def finish(m, gid):
    m.complete(f"{gid}.0")
    m.occupy(gid)


# ---- areal: StalenessManager.get_capacity and wait_results -------------------------------------------
def test_baseline_areal_admission_is_accepted_plus_running_below_eta_v_plus_1_times_b():
    m = AReaLBuffer(StalenessSpec(eta=1, batch_size=2))
    for g in range(4):  # (eta + v + 1) * B = 4 groups at v = 0
        assert m.can_admit(0)
        start(m, g)
    assert not m.can_admit(0)
    finish(m, 0)
    finish(m, 1)
    assert not m.can_admit(0)  # accepted (2) + running (2) = 4: completed groups keep counting
    assert m.consume(0) == [0, 1] and not m.can_admit(1)  # consuming does not free capacity ...
    m.on_rollout_version(1)  # ... the rollout version does: (1 + 1 + 1) * 2 - 4 = 2
    assert m.can_admit(1)
    start(m, 4, V=1)
    m.abort_group(2, "filter")  # a rejected group frees its slot (not counted as accepted)
    assert (m.accepted, m.running) == (2, 2) and m.can_admit(1)
    m.validate()


def test_baseline_areal_concurrency_cap_and_batches_of_the_earliest_started_completed_groups():
    m = AReaLBuffer(StalenessSpec(eta=3, batch_size=2), max_concurrent=3)
    for g in range(3):
        start(m, g)
    assert not m.can_admit(0)  # the cap binds before the staleness formula (8 groups)
    for g in (2, 1):  # completed in the order 2, 1: the trainer is busy and both wait
        finish(m, g)
    start(m, 3)
    finish(m, 3)
    finish(m, 0)
    assert m.consume(0) == [0, 1]  # the two that STARTED first among the completed, not completion order
    assert m.consume(1) is not None and m.consumption_log()[-2:] == [(2, 0, 1), (3, 0, 1)]
    assert m.over_eta() == 0 and not m.bounded


def test_baseline_areal_trains_a_group_beyond_eta_and_counts_it():
    m = AReaLBuffer(StalenessSpec(eta=1, batch_size=1))
    start(m, "slow")
    start(m, "a")
    finish(m, "a")
    m.consume(0)
    for v in (1, 2):  # the slow group keeps running while two more groups are trained
        m.on_rollout_version(v)
        start(m, f"g{v}", V=v)
        finish(m, f"g{v}")
        assert m.consume(v) == [f"g{v}"]
    m.on_rollout_version(3)
    finish(m, "slow")
    assert m.consume(3) == ["slow"] and m.over_eta() == 1  # staleness 3 > eta 1: allowed, reported


# ---- verl fully-async: the staleness_threshold window counter -----------------------------------------
def test_baseline_verl_fully_async_window_counter_resets_to_the_carry_over():
    m = VerlAsyncBuffer(StalenessSpec(eta=1, batch_size=2), staleness_threshold=0.5, n_instances=4)
    assert (m.max_required, m.max_queue, m.max_concurrent) == (3, 3, 3)  # int(2 * 1.5); min(16 * 4, 3)
    for g in range(3):
        start(m, g)
    assert not m.can_admit(0)
    finish(m, 1)
    finish(m, 0)
    assert not m.can_admit(0)  # completions do not reopen the window: only a new version does
    assert m.consume(0) == [1, 0]  # completion order (FIFO message queue)
    m.on_rollout_version(1)  # carry-over: 1 active + 0 queued
    assert m.staleness_samples == 1 and m.can_admit(1)
    start(m, 3, V=1)
    start(m, 4, V=1)
    assert not m.can_admit(1) and m.staleness_samples == 3
    m.validate()


def test_baseline_verl_fully_async_matched_eta_is_s_equals_eta():
    m = build_protocol("verl-fully-async", StalenessSpec(eta=2, batch_size=4), n_instances=2)
    assert isinstance(m, VerlAsyncBuffer) and m.staleness_threshold == 2.0 and m.max_required == 12
    with pytest.raises(ProtocolError, match="batch redundancy"):
        build_protocol("verl-fully-async", StalenessSpec(eta=2, batch_size=4, capacity=5))


def test_baseline_modes_name_their_protocols_and_aliases_resolve():
    assert isinstance(build_protocol("areal", StalenessSpec(1, 2)), AReaLBuffer)
    assert isinstance(build_protocol("sync", StalenessSpec(0, 2)), StalenessManager)
    assert build_protocol("staleflow-no-exchange", StalenessSpec(1, 2)).exchange is False
    assert build_protocol("staleflow", StalenessSpec(1, 2)).exchange is True
    assert BASELINES == (  # the registry's peers
        "verl-sync",
        "verl-one-step-off",
        "verl-fully-async",
        "areal",
        "pipelinerl",
        "pipelinerl-reserve",
    )
    assert [mode_of(m).peer for m in BASELINES] == ["verl", "verl", "verl", "areal", "pipelinerl", "pipelinerl"]
    assert mode_of("one-step-off").name == "verl-one-step-off" and mode_of("verl-sync").colocated


# ---- weight-sync rules through the shared loop ---------------------------------------------------------
def loop_of(mode, n_inst=2, eta=2, B=2):
    ccfg, stale = apply_mode(mode, CoordinatorConfig(), StalenessConfig(eta=eta, batch_size=B, group_size=1))
    be = ScriptedBackend(reward=1.0)
    return build_loop(mode, stale, ccfg, COST, range(n_inst), be, Prompts(), 5), be


def step(loop, be, *events):
    be.events.extend(events)
    loop.turn(be.now())
    loop.tick(be.now())
    loop.maybe_train()


def routes(be):
    return [c for c in be.sent if isinstance(c, Route)]


@pytest.mark.parametrize("mode", ["areal", "verl-fully-async"])
def test_baseline_pause_all_interrupts_every_instance_and_holds_routing_and_trainer(mode):
    loop, be = loop_of(mode)
    step(loop, be)
    first = routes(be)
    assert {r.instance for r in first} == {0, 1} and all(r.traj_version == 0 for r in first)
    assert [r.instance for r in first[:4]] == [0, 1, 0, 1]  # round-robin
    done = [r.traj_id for r in first[:2]]
    step(loop, be, *[Finished(t, r.instance, f"h{t}", 5) for t, r in zip(done, first)])
    assert [v for v, _ in be.trained] == [0]
    be.sent.clear()
    step(loop, be, Published(1))  # the trainer sent version 1: one global update
    pulls = [c for c in be.sent if isinstance(c, Pull)]
    interrupts = [c for c in be.sent if isinstance(c, Interrupt)]
    assert sorted(p.instance for p in pulls) == [0, 1] and {i.instance for i in interrupts} == {0, 1}
    running = {t for i in interrupts for t in i.traj_ids}
    be.sent.clear()
    step(
        loop,
        be,
        *[Finished(t, i.instance, f"p{t}", 2, partial=True) for i in interrupts for t in i.traj_ids],
        PullDone(0, 1),
    )
    assert routes(be) == [] and loop.coord.trainer_blocked()  # instance 1 still loads: nothing moves
    step(loop, be, PullDone(1, 1))
    assert routes(be) and not loop.coord.trainer_blocked()
    back = [r for r in routes(be) if r.traj_id in running]
    assert back and all(r.traj_version == 0 for r in back)  # resumed partial work keeps V_traj
    if mode == "areal":  # sticky: resubmitted to the server it ran on
        origin = {t: i.instance for i in interrupts for t in i.traj_ids}
        assert all(r.instance == origin[r.traj_id] for r in back)


def test_baseline_verl_one_step_off_batch_k_plus_1_uses_the_weights_before_step_k():
    loop, be = loop_of("verl-one-step-off", n_inst=2, eta=1, B=2)
    step(loop, be)
    batch1 = routes(be)
    assert len(batch1) == 2 and all(r.traj_version == 0 for r in batch1)  # one batch of B groups
    step(loop, be, *[Finished(r.traj_id, r.instance, "h", 5) for r in batch1])
    assert [v for v, _ in be.trained] == [0]  # batch 1 trains (staleness 0) ...
    batch2 = [r for r in routes(be) if r not in batch1]
    assert len(batch2) == 2 and all(r.traj_version == 0 for r in batch2)  # ... while batch 2 runs on w0
    be.sent.clear()
    step(loop, be, TrainDone(1), Published(1))
    assert not [c for c in be.sent if isinstance(c, Pull)]  # batch 2 in flight: no sync mid-batch
    step(loop, be, *[Finished(r.traj_id, r.instance, "h", 5) for r in batch2])
    assert [c for c in be.sent if isinstance(c, Pull)] and len(be.trained) == 1  # sync before training batch 2
    assert not [r for r in routes(be) if r.traj_version == 1]  # and before generating batch 3
    step(loop, be, PullDone(0, 1), PullDone(1, 1))
    assert [v for v, _ in be.trained] == [0, 1] and [g.traj_version for g in be.trained[1][1]] == [
        0,
        0,
    ]  # staleness exactly 1
    assert {r.traj_version for r in routes(be)[-2:]} == {1}


def test_baseline_verl_sync_generates_then_trains_then_updates():
    loop, be = loop_of("verl-sync", n_inst=2, eta=3, B=2)
    assert loop.spec.eta == 0
    step(loop, be)
    batch = routes(be)
    assert len(batch) == 2
    step(loop, be, *[Finished(r.traj_id, r.instance, "h", 5) for r in batch])
    assert len(routes(be)) == 2  # nothing new while the batch trains (eta 0)
    step(loop, be, TrainDone(1), Published(1))
    step(loop, be, PullDone(0, 1), PullDone(1, 1))
    assert [r.traj_version for r in routes(be)[2:]] == [1, 1]


# ---- every baseline end to end in the simulator ---------------------------------------------------------
@pytest.mark.parametrize("mode", BASELINES)
def test_baseline_runs_in_the_simulator_through_the_shared_loop(mode):
    from sim_helpers import tiny_sim

    from staleflow.sim.simulator import build, run

    cfg = tiny_sim()
    loop, _, _ = build(cfg, mode, 2)
    assert type(loop.manager) is type(build_protocol(mode, StalenessSpec(2, 3)))
    r = run(cfg, mode, 2)
    assert r.violations == [] and r.steps_done == 8
    if mode == "verl-sync":
        assert set(r.staleness_hist) == {0}
    if mode == "verl-one-step-off":
        assert r.staleness_hist == {0: 3, 1: 21}


@pytest.mark.parametrize("mode", ["staleflow", *BASELINES, "staleflow-no-exchange", "staleflow-simple-strategies"])
def test_baseline_every_mode_resolves_through_the_run_config(mode):
    # The runtime applies --mode with config.resolve (dataclasses.replace re-runs every check,
    # finiteness included): a mode whose settings a check refuses could not start a real run
    # (verl-fully-async's "never migrate" psi was inf and failed exactly so).
    from staleflow.config import RunConfig, resolve

    cfg = resolve(RunConfig(mode=mode))
    assert cfg.mode == mode and cfg.coordinator == apply_mode(mode, RunConfig().coordinator, RunConfig().staleness)[0]
    if mode == "verl-fully-async":
        assert cfg.coordinator.psi == 0  # its throughput-gap trigger is off (NEVER_MIGRATE)
