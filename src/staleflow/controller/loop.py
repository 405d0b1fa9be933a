"""The controller loop: prompts -> coordinator -> rollout -> rewards -> staleness buffers -> trainer.

One loop, single-threaded, shared by the real runtime and the simulator (only the Backend
differs). Each turn of ``run``:
  1. events from the backend: snapshots, finished or interrupted trajectories, rewards, pulls,
     finished training steps, published versions;
  2. train: when buffer ``version`` is Ready, the trainer is idle and the mode's weight-sync rule
     lets it start (peers whose trainer sends the weights wait for every instance to load them),
     Consume it;
  3. refill: keep enough fresh prompt groups (N' members each) in the Trajectory Server queue;
  4. every tick: the coordinator's Snapshot-Command cycle; its Route / Interrupt / Pull / Abort
     commands are executed at once, and their immediate effects handled.
The ledger is the only table of trajectories; the batch protocol (StaleFlow's StalenessManager or
a peer's count-based rule, chosen by the mode) decides admission and batches; the Coordinator holds
the queue and its view of the instances, by id, and reads a trajectory's facts from the ledger (the
loop writes them: V_traj once at its first route, tokens and origin at a loop-back). The loop audits the protocol from outside (controller/audit.py).
A front end drives the loop with ``run`` only and reads it through ``view`` (controller/view.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from staleflow.controller.audit import Audit
from staleflow.controller.backend import Backend, Published, PullDone, Rewarded, TrainDone
from staleflow.controller.ledger import Ledger, Traj
from staleflow.controller.step_metrics import step_metrics
from staleflow.controller.training import Refill, consume
from staleflow.controller.types import LoopSettings, LoopTimeout, RewardsFailing, Stalled, StepRecord, Workload
from staleflow.controller.view import LoopView
from staleflow.coordinator.coordinator import Coordinator
from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull
from staleflow.trajectory import Finished, Route, TurnStats


class ControllerLoop:
    def __init__(
        self,
        settings: LoopSettings,
        coordinator: Coordinator,
        ledger: Ledger,
        backend: Backend,
        workload: Workload,
        version: int = 0,
        on_step: Callable[[StepRecord, dict], None] | None = None,
        listeners: Mapping[type, Callable[[Any], None]] | None = None,
        counts: Mapping[str, int] | None = None,
        requeue: Iterable = (),
    ):
        """on_step: the step event (the record and its metrics); listeners: a front end's own events
        (type -> handler) that its backend yields among the loop's (the runtime's Saved checkpoint
        and Evaluated held-out answers). counts, requeue: a resumed run's counters and the prompts in
        flight at its checkpoint (submitted again as fresh groups)."""
        if coordinator.trajs is not ledger.trajs:
            raise ValueError(
                "the coordinator must look trajectories up in this ledger's table: build both with build_loop"
            )
        self.s, self.coord, self.manager = settings, coordinator, coordinator.manager
        self.spec = coordinator.manager.spec
        """eta, B, B', N, N' (the protocol's StalenessSpec)."""
        self.ledger, self.backend, self.workload = ledger, backend, workload
        self.version = version
        """The trainer's version: the next buffer it trains."""
        self.published = version
        self.training: StepRecord | None = None
        self._hold: bool | Callable[[], bool] = False
        """While a run(hold_training=...) says so, no buffer is consumed (a front end acts between two steps)."""
        self.steps: list[StepRecord] = []
        self.on_step = on_step
        self.counts: Counter = Counter()
        self.reward_errors: Counter = Counter()
        self.first_reward_error = ""
        self.reward_failures_in_a_row = 0
        self.no_signal = Refill(settings.refill_groups, coordinator, self.counts)  # DAPO dynamic sampling refill
        self.audit = Audit()
        self.unrouted: set[int] = set()  # live groups none of whose members was routed yet
        self.response_lens: list[int] = []
        self.turn_stats: list[TurnStats] = []  # multi-turn: the figures of each finished trajectory
        self.progress_at = backend.now()
        self.listeners = dict(listeners or {})
        self.tokens_generated: dict[int, int] = {}
        """Tokens each instance has generated so far (its newest snapshot)."""
        self._next_tick = backend.now()
        self.view = LoopView(self)
        """What a front end reads (checkpoints, metrics, wait conditions); it drives the loop with ``run`` only."""
        self.counts.update(counts or {})
        for prompt in requeue:
            self.submit_group(prompt)

    # ---- prompts ---------------------------------------------------------------------------
    def submit_group(self, prompt) -> None:
        draws = [self.workload.new_member() for _ in range(self.spec.group_capacity)]
        plen = self.workload.prompt_len(prompt)
        g = self.ledger.new_group(prompt, [d[0] for d in draws], [d[1] for d in draws], prompt_len=plen)
        self.coord.submit(g.members)
        self.unrouted.add(g.group_id)

    def refill(self) -> None:
        """Keep 2 * (eta + 1) * B' fresh groups queued: admission, never supply, limits the rollout."""
        want = 2 * (self.spec.eta + 1) * self.spec.capacity
        while len(self.unrouted) < want:
            self.submit_group(self.workload.next_prompt())

    # ---- events ------------------------------------------------------------------------------
    def handle(self, ev) -> None:
        if isinstance(ev, InstanceSnapshot):
            self.tokens_generated[ev.instance] = ev.tokens_generated
            self.coord.on_snapshot(ev)
        elif isinstance(ev, Finished):
            self.on_finished(ev)
        elif isinstance(ev, Rewarded):
            self.on_rewarded(ev)
        elif isinstance(ev, PullDone):
            self.coord.on_pull_done(ev.instance, ev.version)
        elif isinstance(ev, TrainDone):
            self.on_train_done(ev)
        elif isinstance(ev, Published):
            self.published = max(self.published, ev.version)
            self.coord.on_new_version(ev.version)
            if self.steps and self.steps[-1].version + 1 == ev.version:
                self.steps[-1].t_published = self.backend.now()
        elif type(ev) in self.listeners:
            self.listeners[type(ev)](ev)
        else:
            raise TypeError(f"unexpected event {type(ev).__name__}")

    def on_finished(self, ev: Finished) -> None:
        t = self.ledger.get(ev.traj_id)
        if t is None:  # dropped meanwhile (an Abort crossed the finish): its record is garbage
            self.counts["late_records"] += 1
            self._free([ev.handle])
            return
        self._free([self.ledger.set_handle(t.traj_id, ev.handle)])
        if ev.stats is not None:  # multi-turn: the newest counts; tool seconds add up over instances
            s, before = ev.stats, t.turns.tool_s if t.turns is not None else 0.0
            t.turns = TurnStats(s.turns, s.tool_calls, before + s.tool_s)
        if ev.partial and not t.truncate:  # the loop-back: queued again, same V_traj, same reservation
            t.n_tokens, t.origin = ev.n_tokens, ev.instance
            self.coord.on_interrupted(ev.instance, [t.traj_id])
            return
        self.finish(t, ev.instance, ev.n_tokens, ev.stats.env_reward if ev.stats is not None else None)

    def finish(self, t: Traj, instance: int, n_tokens: int, env_reward: float | None = None) -> None:
        """Generation of `t` is over: the coordinator counts it (or has already dropped it), then score
        it (a multi-turn trajectory's environment may have given its reward already)."""
        if not self.coord.on_finished(instance, t.traj_id):
            self._drop(t.traj_id, "late-finish")  # surplus or closed window: its Abort is on its way
            return
        self.ledger.accept_finish(t.traj_id, n_tokens)
        self.response_lens.append(n_tokens)
        if t.turns is not None and t.turns.turns:
            self.turn_stats.append(t.turns)
        self.progress_at = self.backend.now()
        if env_reward is not None:
            self.on_rewarded(Rewarded(t.traj_id, float(env_reward)))
            return
        g = self.ledger.groups[t.group_id]
        self.backend.score(t.traj_id, t.handle, g.prompt)

    def on_rewarded(self, ev: Rewarded) -> None:
        t = self.ledger.set_reward(ev.traj_id, ev.reward, ev.error)
        if t is None:
            return
        t.text = ev.text
        if ev.error:
            self.reward_errors[ev.error.split(":", 1)[0]] += 1
            self.first_reward_error = self.first_reward_error or ev.error
            self.reward_failures_in_a_row += 1
            k = self.s.max_reward_failures
            if k and self.reward_failures_in_a_row >= k:
                raise RewardsFailing(
                    f"{k} reward calls in a row failed (first error: {self.first_reward_error}; "
                    f"last: {ev.error}): fix --reward.fn, or raise --reward.max-consecutive-failures"
                )
        else:
            self.reward_failures_in_a_row = 0
        self.progress_at = self.backend.now()
        self.maybe_occupy(t.group_id)

    def maybe_occupy(self, group_id: int) -> None:
        """Occupy once the group's N accepted finishers are all rewarded."""
        members = self.ledger.rewarded_members(group_id, self.spec.group_size)
        if members is None or self.no_signal.replaces(group_id, members, self.version):
            return
        v = self.coord.on_rewarded(group_id)
        if v is not None:  # None: its window closed meanwhile; the coordinator aborts the group
            self.ledger.occupy(group_id)

    # ---- commands ------------------------------------------------------------------------------
    def execute(self, cmd) -> None:
        if isinstance(cmd, Route):
            self._route(cmd)
        elif isinstance(cmd, Interrupt) and cmd.instance < 0:  # queued stragglers: their partial is final
            for tid in cmd.traj_ids:
                t = self.ledger.get(tid)
                if t is None:
                    continue
                if t.handle is None:  # never generated a token: nothing to keep
                    self.coord.on_failed(-1, tid, "truncated-empty")
                    self._drop(tid, "truncated-empty")
                else:
                    self.finish(t, -1, t.n_tokens)
        elif isinstance(cmd, Interrupt):
            if cmd.reason == "truncate":
                for tid in cmd.traj_ids:
                    if tid in self.ledger.trajs:
                        self.ledger.trajs[tid].truncate = True
            self.backend.interrupt(cmd)
            self.counts["interrupts"] += 1
            self.counts["migrations"] += cmd.reason == "migrate"
        elif isinstance(cmd, Pull):
            self.backend.pull(cmd)
            self.counts["pulls"] += 1
        elif isinstance(cmd, Abort):
            if cmd.instance >= 0:
                self.backend.abort(cmd)
            for tid in cmd.traj_ids:
                self.audit.aborted(tid, self.ledger.ended.get(tid))
                self._drop(tid, cmd.reason)
            self.counts[f"aborted_{cmd.reason}"] += len(cmd.traj_ids)
            if cmd.group_id >= 0:
                self._drop_group(cmd.group_id, cmd.reason, cmd.retry)
        else:
            raise TypeError(f"unexpected command {type(cmd).__name__}")

    def _pull_all(self, version: int) -> None:
        """Every instance loads ``version`` (a resumed run's first act, and before the final evaluation)."""
        for inst in self.coord.instances:
            self.execute(Pull(instance=inst, version=version))

    def _route(self, cmd: Route) -> None:
        t = self.ledger.trajs[cmd.traj_id]
        g = self.ledger.groups[t.group_id]
        self.audit.route(g.group_id, t.traj_id, t.traj_version, cmd.traj_version)
        if t.traj_version is None:  # written once: a loop-back's route carries the same V_traj (audited)
            t.traj_version = cmd.traj_version
        self.unrouted.discard(g.group_id)
        self.backend.route(
            msgspec.structs.replace(
                cmd,
                prompt_ids=self.workload.prompt_ids(g.prompt),
                prompt_len=self.workload.prompt_len(g.prompt),
                seed=t.seed,
                partial=t.handle,
                max_new_tokens=t.target_len,
                **self.workload.env_fields(g.prompt),
            )
        )
        self.counts["routes"] += 1

    def _free(self, handles) -> None:
        hs = [h for h in handles if h is not None]
        if hs:
            self.backend.free(hs)

    def _drop(self, traj_id: int, reason: str) -> None:
        t = self.ledger.drop(traj_id, reason)
        if t is not None:
            self._free([t.handle])

    def _drop_group(self, group_id: int, reason: str, retry: bool) -> None:
        g, dropped = self.ledger.drop_group(group_id, reason)
        if g is None:
            return
        self._free([t.handle for t in dropped])
        self.unrouted.discard(group_id)
        self.audit.group_tag.pop(group_id, None)
        self.counts["groups_aborted"] += 1
        if retry:
            self.submit_group(g.prompt)

    # ---- training ------------------------------------------------------------------------------
    def maybe_train(self) -> None:
        if self.training is not None or self.version >= self.s.steps or self.holding:
            return
        if self.manager.ready_version() != self.version or self.coord.trainer_blocked():
            return
        v = self.version  # (controller/training.py: group-id order, members by id, each group audited)
        batch, stale, samples, prompts = consume(v, self.manager, self.ledger, self.audit, self.workload, self._free)
        self.training = StepRecord(v, self.backend.now(), batch, stale, samples=samples, prompts=prompts)
        self.backend.train(v, batch)

    def on_train_done(self, ev: TrainDone) -> None:
        rec = self.training
        if rec is None or ev.version != rec.version + 1:
            raise RuntimeError(
                f"TrainDone({ev.version}) but the trainer was training {None if rec is None else rec.version}"
            )
        self.training = None
        rec.t_done, rec.train = self.backend.now(), ev
        self._free([h for g in rec.groups for h in g.handles])
        self.version = ev.version
        self.steps.append(rec)
        self.progress_at = rec.t_done
        if self.on_step is not None:
            self.on_step(rec, self.step_metrics(rec))

    def step_metrics(self, rec: StepRecord) -> dict:
        """The per-step numbers every front end reports (runtime metrics.jsonl, simulator tables)."""
        lens, self.response_lens = self.response_lens, []
        turns, self.turn_stats = self.turn_stats, []
        row = step_metrics(rec, lens, self.audit, self.counts, sum(self.reward_errors.values()), turns, self.manager)
        if self.coord.cfg.tail_lanes:  # (--coordinator.tail-lanes: lanes opened so far, coordinator/lanes.py)
            row["lanes_opened"] = self.coord.counters["lanes_opened"]
        return row

    # ---- the loop ------------------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        """A front end holds training (run(hold_training=...)): no buffer is consumed."""
        return self._hold() if callable(self._hold) else self._hold

    @property
    def done(self) -> bool:
        return self.published >= self.s.steps and self.training is None

    def tick(self, now: float) -> None:
        for cmd in self.coord.tick(now):
            self.execute(cmd)
        for ev in self.backend.poll(now):  # immediate effects of the commands (simulated instances)
            self.handle(ev)

    def turn(self, next_tick: float, dispatch: bool = True) -> float:
        """One turn of the loop; returns the time of the next coordinator tick. Once the run is
        done (or without ``dispatch``) nothing new is started: events are still handled (a final
        evaluation, a save, the step that finishes while the run stops)."""
        for ev in self.backend.poll(next_tick):
            self.handle(ev)
        if not dispatch:  # wait for events up to a tick at a time (no busy polling)
            return max(next_tick, self.backend.now() + self.s.tick_s)
        if self.done:
            return next_tick
        self.maybe_train()
        self.refill()
        now = self.backend.now()
        if now >= next_tick:
            self.tick(now)
            self.maybe_train()
            next_tick = now + self.s.tick_s
        return next_tick

    def run(
        self,
        until: Callable[[], bool] | None = None,
        timeout_s: float | None = None,
        what: str = "",
        *,
        hold_training: bool | Callable[[], bool] = False,
        dispatch: bool = True,
        pull: int | None = None,
        stall_s: float | Callable[[], float] | None = None,
    ) -> None:
        """The one driver of the loop (runtime and simulator): turn until ``until()`` holds (default:
        --steps versions published and trained). hold_training: no buffer is consumed while it holds
        (a checkpoint between two steps); dispatch=False: events only, nothing new starts (a stopping
        run lets its step finish); pull: every instance first loads this version; stall_s: this run's
        stall limit (a callable is read every turn). Raises Stalled when nothing finished and no step
        ran for the stall limit while work was due and training was not held, LoopTimeout when
        ``until`` did not hold within ``timeout_s`` of the backend's clock (``what`` names the wait)."""
        stop = until or (lambda: self.done)
        if pull is not None:
            self._pull_all(pull)
        start = self.backend.now()
        self._hold = hold_training
        try:
            while not stop():
                self._next_tick = self.turn(self._next_tick, dispatch)
                now = self.backend.now()
                if timeout_s is not None and now - start > timeout_s:
                    raise LoopTimeout(f"{what or 'the wait'} did not happen within {timeout_s:.0f} s")
                limit = stall_s() if callable(stall_s) else (self.s.stall_s if stall_s is None else stall_s)
                if not self.done and dispatch and not self.holding and now - self.progress_at > limit:
                    raise Stalled(
                        f"no trajectory finished and no step ran for {limit:.0f} s "
                        f"(version {self.version}, buffer state "
                        f"{self.manager.buffer_state(self.manager.version).value})"
                    )
        finally:
            self._hold = False
