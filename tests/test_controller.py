"""The shared controller loop in-process, against a scripted backend (no ranks, no simulator).

Covers the races and rules the runtime and the simulator must agree on: a group-redundancy
surplus whose finish crosses its Abort (the stall found in review), loop-backs that return to
their origin instance when migration is off, and pulls that keep running work when
interrupt-on-pull is off (in the loop and in the rollout rank).
"""

from __future__ import annotations

import pytest
from controller_fakes import Prompts, ScriptedBackend

from staleflow.config import CoordinatorConfig, StalenessConfig
from staleflow.controller import Finished, LoopSettings, Published, Rewarded
from staleflow.controller.build import build_loop
from staleflow.coordinator import Abort, CostModel, Interrupt, Pull, Route
from staleflow.coordinator.record import INTERRUPT, ROUTE, SUBMIT
from staleflow.modes import apply_mode

COST = CostModel(k1=1e-7, k2=0.02, k3=2e-4, b3=0.01, k4=1e-3, kv_capacity=100_000, name="test")


def make_loop(n_inst=1, eta=1, B=1, N=1, Np=None, mode="staleflow", steps=2, **coord):
    coord.setdefault("routing", "least-loaded")
    coord.setdefault("mlq", False)
    stale = StalenessConfig(eta=eta, batch_size=B, group_size=N, group_redundancy=(Np or N) - N)
    ccfg, stale = apply_mode(mode, CoordinatorConfig(**coord), stale)
    be = ScriptedBackend()
    return build_loop(mode, stale, ccfg, COST, range(n_inst), be, Prompts(), steps), be


def deliver(loop, be, *events):
    be.events.extend(events)
    for ev in be.poll(be.t):
        loop.handle(ev)


def routed(be):
    return [c for c in be.sent if isinstance(c, Route)]


def test_controller_surplus_finish_crossing_its_abort_does_not_stall_the_group():
    """N = 2 of N' = 3: the third member finishes after the group completed but before the
    coordinator's Abort reached its rank. It must not count; the group occupies and trains."""
    loop, be = make_loop(n_inst=1, eta=1, B=1, N=2, Np=3, migration=False)
    loop.refill()
    loop.tick(be.now())
    by_group: dict[int, list[int]] = {}
    for r in routed(be):
        by_group.setdefault(loop.ledger.trajs[r.traj_id].group_id, []).append(r.traj_id)
    gid, (a, b, c) = next(
        (g, ids)
        for g, ids in by_group.items()  # the group reserved in buffer 0
        if len(ids) == 3 and loop.manager.group_info(g)["buffer_version"] == 0
    )
    deliver(loop, be, Finished(a, 0, "rec-a", 5), Finished(b, 0, "rec-b", 6))  # b completes the group
    deliver(loop, be, Finished(c, 0, "rec-c", 7))  # the surplus finishes before its Abort is executed
    assert "rec-c" in be.freed and c not in be.scored and c not in loop.ledger.trajs
    deliver(loop, be, Rewarded(a, 1.0), Rewarded(b, 0.0))
    loop.maybe_train()
    assert [v for v, _ in be.trained] == [0]
    (group,) = [g for g in be.trained[0][1] if g.group_id == gid]
    assert sorted(group.traj_ids) == sorted([a, b]) and group.rewards in ([1.0, 0.0], [0.0, 1.0])
    loop.tick(be.now() + 1)  # the Abort now goes out; it finds nothing left to drop
    assert Abort(0, (c,), "surplus") in be.sent
    assert loop.audit.violations == [] and loop.ledger.ended[c].startswith("aborted")


@pytest.mark.parametrize("migration", [False, True])
def test_controller_migration_off_returns_loop_backs_to_their_origin(migration):
    loop, be = make_loop(n_inst=2, eta=1, B=2, N=1, migration=migration, migration_cooldown_s=86400.0)
    loop.refill()
    loop.tick(be.now())
    first = routed(be)
    origin = first[0].instance
    tids = [r.traj_id for r in first if r.instance == origin]
    other = 1 - origin
    # the origin instance is now the busier one: a free choice would send loop-backs elsewhere
    for k in range(3):  # placeholders held by the origin (through the transition function, as a route would)
        loop.coord.sched.transition(10_000 + k, SUBMIT, group_id=10_000 + k, tokens=10)
        loop.coord.sched.transition(10_000 + k, ROUTE, instance=origin, kv=10, now=be.now())
    for t in tids:
        loop.coord.sched.transition(t, INTERRUPT, reason="pull")
    deliver(loop, be, *[Finished(t, origin, f"partial-{t}", 3, partial=True) for t in tids])
    for r in first:  # the ledger's record is what the coordinator reads: V_traj from the first route, origin
        rec = loop.ledger.trajs[r.traj_id]
        assert rec.traj_version == r.traj_version and rec.prompt_len == r.prompt_len > 0
        assert (rec.origin, rec.n_tokens) == ((origin, 3) if r.traj_id in tids else (-1, 0))
    be.sent.clear()
    loop.tick(be.now() + 1)
    back = [r for r in routed(be) if r.traj_id in tids]
    assert len(back) == len(tids) >= 1
    for r in back:  # same V_traj; the instance is charged the record's prompt + generated tokens
        rec = loop.ledger.trajs[r.traj_id]
        assert r.traj_version == rec.traj_version and loop.coord.instances[r.instance].trajs[r.traj_id].kv == rec.tokens
        assert rec.tokens == rec.prompt_len + 3
    if migration:  # free to go where the load is lower
        assert other in {r.instance for r in back}, back
    else:
        assert {r.instance for r in back} == {origin}, back


@pytest.mark.parametrize("interrupt_on_pull", [True, False])
def test_controller_interrupt_on_pull_false_drains_before_the_pull(interrupt_on_pull):
    """Partial rollout interrupts the work and pulls at once; without it (the ablation) the instance
    takes no new work, its trajectories finish under the old weights, and only then does it pull."""
    loop, be = make_loop(n_inst=1, eta=2, B=2, N=1, migration=False, pull="greedy", interrupt_on_pull=interrupt_on_pull)
    loop.refill()
    loop.tick(be.now())
    running = [r.traj_id for r in routed(be)]
    assert running
    loop.coord.manager.version = 1  # a trained version exists
    deliver(loop, be, Published(1))
    be.sent.clear()
    loop.tick(be.now() + 1)
    pulls = [c for c in be.sent if isinstance(c, Pull)]
    interrupts = [c for c in be.sent if isinstance(c, Interrupt)]
    if interrupt_on_pull:
        assert pulls == [Pull(0, 1)]
        assert interrupts and set(interrupts[0].traj_ids) == set(running)
        return
    assert pulls == [] and interrupts == [] and loop.coord.instances[0].draining
    deliver(loop, be, *[Finished(t, 0, f"rec-{t}", 4) for t in running[:-1]])
    be.sent.clear()
    loop.tick(be.now() + 1)
    assert be.sent == []  # still draining: one trajectory left, and no new work is routed to it
    deliver(loop, be, Finished(running[-1], 0, "rec-last", 4))
    assert set(running) <= set(be.scored)  # finished under the old weights, normally
    loop.tick(be.now() + 1)
    assert [c for c in be.sent if isinstance(c, Pull)] == [Pull(0, 1)]
    # new work follows the pull (queued in the engine behind the load), tagged with the new version
    assert routed(be) and all(r.traj_version == 1 for r in routed(be))


class _Engine:
    def __init__(self):
        self.aborted, self.loads = [], []

    def weight_targets(self):
        return {}

    def stats(self):
        class S:
            running_ids, waiting_ids = [7, 8], []

        return S()

    def abort(self, ids):
        self.aborted += list(ids)
        return []

    def load_weights(self, tensors, version, keep_kv=False):
        self.loads.append((version, keep_kv))


@pytest.mark.parametrize("keep", [True, False])
def test_controller_rollout_rank_pull_honours_interrupt_on_pull(keep):
    from staleflow.workers.rollout import RolloutWorker

    class Source:  # the rank's one weight source (servers/weights.py): loads, then stamps
        def load(self, engine, keep_kv):
            engine.load_weights(engine.weight_targets(), 1, keep_kv=keep_kv)
            return 1, 64, {0: 64}  # (version, bytes, {source node: bytes})

    sent = []
    w = RolloutWorker.__new__(RolloutWorker)
    w.engine, w.weights, w.instance, w.keep_on_pull = _Engine(), Source(), 0, keep
    w.meta, w.unsent, w.net = {}, [], None  # one node
    from staleflow.cluster.roles import Roles

    w.ctx = type(
        "Ctx",
        (),
        {
            "client": type("C", (), {"send": staticmethod(sent.append)})(),
            "roles": Roles(3, 2),
            "rank": 1,
            "run_id": "x",
        },
    )()
    w.pull(Pull(0, 1))
    assert w.engine.loads == [(1, keep)]
    assert w.engine.aborted == ([] if keep else [7, 8])


@pytest.mark.parametrize("keep_kv", [True, False])
def test_controller_builtin_engine_keeps_kv_across_a_load_only_when_asked(keep_kv):
    """interrupt-on-pull false in the real engine: running sequences continue on the KV computed with
    the old weights (no prefill after the load); otherwise their KV is recomputed."""
    import torch

    from staleflow.model import CausalLM, ModelArgs
    from staleflow.rollout import BuiltinEngine, Request, SamplingParams

    model = CausalLM(ModelArgs(vocab_size=64, eos_token_ids=[1])).init_weights(seed=0)
    eng = BuiltinEngine(model, max_kv_tokens=256, block_size=4, prefill_chunk_tokens=64, max_model_len=64, profile=True)
    eng.add(Request(0, list(range(2, 12)), SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)))
    for _ in range(3):
        eng.step()
    before = len(eng.profile_samples)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng.load_weights(weights, 1, keep_kv=keep_kv)
    eng.step()
    after = eng.profile_samples[before]
    assert (after.prefill_tokens == 0) == keep_kv, after
    while eng.has_unfinished():
        eng.step()
    assert torch.is_tensor(next(model.parameters()))


def test_controller_reward_failures_are_counted_and_k_in_a_row_stop_the_run():
    from staleflow.controller import RewardsFailing

    loop, be = make_loop(n_inst=1, eta=1, B=3, N=1)
    loop.s = LoopSettings(**{**loop.s.__dict__, "max_reward_failures": 3})
    loop.refill()
    loop.tick(be.now())
    tids = [r.traj_id for r in routed(be)]
    deliver(loop, be, *[Finished(t, 0, f"rec-{t}", 4) for t in tids])
    deliver(loop, be, Rewarded(tids[0], 0.0, "ZeroDivisionError: x"), Rewarded(tids[1], 1.0))
    assert loop.reward_errors == {"ZeroDivisionError": 1} and loop.first_reward_error == "ZeroDivisionError: x"
    assert loop.reward_failures_in_a_row == 0  # a success resets the streak
    more = tids[2:5]
    assert len(more) == 3
    with pytest.raises(RewardsFailing, match="3 reward calls in a row failed.*ZeroDivisionError"):
        deliver(loop, be, *[Rewarded(t, 0.0, "TypeError: returned 'x'") for t in more])


def test_controller_run_is_the_one_driver_front_end_events_go_to_listeners():
    """run() turns until its condition; a front end's own events (the runtime's checkpoint and
    held-out answers) reach its listeners; an event nobody listens for is an error."""
    import dataclasses

    from staleflow.controller import LoopTimeout

    class Saved:  # a front-end event type the loop knows nothing about
        pass

    loop, be = make_loop()
    got = []
    loop.listeners[Saved] = got.append
    be.events.append(Saved())
    loop.run(until=lambda: bool(got), timeout_s=5)
    assert len(got) == 1 and routed(be)  # the loop kept working while it waited
    with pytest.raises(LoopTimeout, match="the saved checkpoint did not happen within 1 s"):
        loop.run(until=lambda: False, timeout_s=1, what="the saved checkpoint")
    be.events.append(object())
    with pytest.raises(TypeError, match="unexpected event object"):
        loop.run(until=lambda: False, timeout_s=5)
    loop.s = dataclasses.replace(loop.s, stall_s=3.0)
    with pytest.raises(LoopTimeout):  # a front end holding training (a checkpoint) is not a stall
        loop.run(until=lambda: False, timeout_s=10, hold_training=True)
    from staleflow.controller import Stalled

    with pytest.raises(Stalled, match="no trajectory finished and no step ran for 3 s"):
        loop.run(until=lambda: False, timeout_s=60)
    with pytest.raises(Stalled, match="no step ran for 2 s"):  # a run's own limit (the job's, read every turn)
        loop.run(until=lambda: False, timeout_s=60, stall_s=lambda: 2.0)


def test_controller_front_end_surface_hold_stop_pull_and_view():
    """What the runtime's job uses, and only that: run(pull=...) loads a version everywhere first;
    hold_training keeps a Ready buffer unconsumed; dispatch=False lets the running step finish and
    starts nothing; the read-only view reports version, training, counters, ids and live prompts."""
    from staleflow.controller import LoopTimeout, TrainDone

    loop, be = make_loop(n_inst=2, eta=1, B=1, N=1, steps=3)
    be.reward = 1.0
    view = loop.view
    loop.run(until=lambda: bool(routed(be)), timeout_s=5, pull=0)
    assert [c.instance for c in be.sent[:2] if isinstance(c, Pull)] == [0, 1] and view.counts()["pulls"] == 2
    t = routed(be)[0].traj_id
    be.events.append(Finished(t, routed(be)[0].instance, f"rec-{t}", 4))
    with pytest.raises(LoopTimeout):
        loop.run(until=lambda: False, timeout_s=1, hold_training=lambda: True)
    assert not be.trained and not view.training and loop.manager.ready_version() == 0
    loop.run(until=lambda: view.training, timeout_s=5)
    assert len(be.trained) == 1 and view.training and view.version == 0
    sent = len(be.sent)
    be.events.extend([TrainDone(1), Published(1)])
    loop.run(until=lambda: not view.training, timeout_s=5, hold_training=True, dispatch=False)
    assert view.version == 1 and not view.training and len(be.sent) == sent and len(be.trained) == 1
    counts = view.counts()
    counts["routes"] = -1
    assert view.counts()["routes"] == len(routed(be))  # a copy: the view is read-only
    next_traj, next_group = view.ids()
    assert next_traj == next_group == len(view.live_prompts()) + 1  # B=1, N=1: one group trained


def test_controller_resume_counters_and_requeued_prompts_go_in_through_build_loop():
    stale = StalenessConfig(eta=1, batch_size=1)
    ccfg, stale = apply_mode("staleflow", CoordinatorConfig(routing="least-loaded", mlq=False), stale)
    be = ScriptedBackend()
    loop = build_loop(
        "staleflow", stale, ccfg, COST, range(1), be, Prompts(), 2, counts={"routes": 5}, requeue=["p0", "p1"]
    )
    assert loop.view.counts()["routes"] == 5 and loop.view.live_prompts() == ["p0", "p1"]
    assert loop.view.ids() == (2 * stale.group_capacity, 2)  # N' members each


def test_controller_the_coordinator_looks_trajectories_up_in_the_loops_ledger():
    """One per-trajectory table: build_loop hands the ledger's to the coordinator; a loop refuses a
    coordinator that reads another table (its facts would drift from the ledger's)."""
    from staleflow.controller import ControllerLoop, Ledger

    loop, be = make_loop()
    assert loop.coord.trajs is loop.ledger.trajs
    loop.refill()
    assert set(loop.coord.records) == set(loop.ledger.trajs) != set()
    with pytest.raises(ValueError, match="this ledger's table"):
        ControllerLoop(loop.s, loop.coord, Ledger(), be, Prompts())
