"""The controller loop's Backend for the simulator: instances, trainer and weights as a discrete-event model.

Simulated time advances in the loop's ticks (``poll(until)``): every instance decodes until
``until`` (sim/engine.py: continuous batching whose step time follows the true cost model, with
noise), its finishes and completed pulls become events, the trainer's timers fire (a step's end,
then the publication of its weights), rewards are instantaneous, and every instance reports a
snapshot. Commands act at once: a Route adds the trajectory to the instance's waiting queue, an
Interrupt returns its partial output (a loop-back), a Pull stops decoding for the transfer time.

How weights travel is the mode's ``weight_sync`` (staleflow.modes): ``ps`` the trainer pushes
to the Parameter Server (push_s) and each instance pulls on its own (pull_s); ``broadcast`` the
trainer sends the weights to the instances (each Pull takes broadcast_s; the pause-all and idle
pull policies hold the trainer and routing until every instance has them); ``colocated`` rollout
and training share the GPUs (the step pays colocated_switch_s, the pull is free).

Multi-turn workloads (sim/turns.py): a Route's seed names the trajectory's TurnPlan (the workload drew
it with the length; ``plans``), which the instance follows; a trajectory's wall time (first route to
its finish, tool waits included) is recorded in ``wall``. Snapshots name the trajectories parked on a
tool call; the coordinator leaves them out of a pull's Interrupt. A Pull with ``pull_interrupts``
(partial rollout without keep-KV) does what the runtime's rollout rank does (workers/rollout.py pull):
it interrupts whatever still decodes or waits on the instance (one the coordinator, a tick behind,
thought parked) and frees the KV the parked ones hold.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque

from staleflow.controller.backend import Published, PullDone, Rewarded, TrainDone
from staleflow.coordinator.cost_model import CostModel
from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull
from staleflow.sim.config import SimConfig
from staleflow.sim.engine import SimInstance, SimSequence
from staleflow.sim.floor import alone_s
from staleflow.sim.hardware import Derived
from staleflow.sim.speculative import spec_cost
from staleflow.trajectory import Finished, RecordHandle, Route, TrainGroup


def sim_record(traj_id: int, instance: int, generated: int, generation: int = 0) -> RecordHandle:
    """A simulated record's handle: no bytes anywhere; ``length`` counts its generated tokens, ``generation``
    numbers the backend's records (a trajectory's newer record supersedes its older ones)."""
    return RecordHandle(rank=instance, offset=traj_id, length=generated, generation=generation)


class SimBackend:
    def __init__(
        self,
        cfg: SimConfig,
        hw: Derived,
        cost: CostModel,
        n_instances: int,
        train_gpus: int,
        weight_sync: str,
        publish_every: int = 1,
        mixed_kv: bool = False,
        plans: dict | None = None,
        pull_interrupts: bool = False,
    ):
        self.cfg, self.hw, self.cost, self.train_gpus, self.sync = cfg, hw, cost, train_gpus, weight_sync
        self.kv_moved: dict[int, tuple[int, int]] = {}  # traj_id -> (KV tokens, their weight version) in transit
        self.records = 0  # records made so far: each record's generation
        self.publish_every = publish_every
        self.pull_interrupts = pull_interrupts
        """Partial rollout with re-prefill (interrupt_on_pull, not keep_kv_on_pull): nothing decodes across a pull."""
        self.plans = plans if plans is not None else {}
        """Route seed -> TurnPlan (the workload's; empty: single-turn)."""
        self.plan_of: dict = {}  # traj_id -> TurnPlan of the trajectories routed so far
        self.first_route: dict[int, tuple[float, float, int]] = {}
        """traj_id -> (its first route, its finish or -1, its newest record's generation) of each trajectory routed and
        not yet trained or dropped. Freeing an older record (a loop-back's newer one replaced it) leaves the entry;
        freeing the newest (trained or dropped) removes it."""
        self.wall: list[float] = []
        """Seconds from each finished trajectory's first route to its finish (tool waits included)."""
        """Weights reach the rollout side every this many steps (verl's trigger_parameter_sync_step T)."""
        self.pull_time = {"ps": hw.pull_s, "broadcast": hw.broadcast_s}.get(weight_sync, 0.0)
        rng = random.Random(cfg.seed * 7919 + 1)
        self.rng = random.Random(rng.getrandbits(32))
        spec = spec_cost(cost, cfg.spec_accept, cfg.spec_draft_tokens)
        self.insts = [
            SimInstance(
                i,
                cost,
                hw.prefill_tokens_per_s,
                cfg.max_running,
                speed=math.exp(rng.gauss(0.0, cfg.instance_spread)),
                noise=cfg.step_noise,
                rng=random.Random(rng.getrandbits(32)),
                kv_move_tokens_per_s=hw.kv_move_tokens_per_s,
                mixed_kv=mixed_kv,
                chunk_tokens=cfg.prefill_chunk_tokens,
                spec=spec,
                spec_rows=cfg.spec_draft_tokens + 1,
                spec_accept=cfg.spec_accept,
            )
            for i in range(n_instances)
        ]
        self.t = 0.0
        self.pending: deque = deque()
        self.timers: list[tuple[float, int, object]] = []
        self._seq = 0
        self._last_tokens = [0] * n_instances
        self.trainer_busy_s = 0.0
        self.train_durs: list[float] = []
        """Seconds the trainer spent on each step (the physical floor reads the measured steps')."""
        self.train_until = 0.0
        self.critical: list[float] = []
        """Per trained step, its critical response's wall time over its decode alone (single-turn runs)."""
        self.step_end: list[float] = []
        """Exact publication time of each trained version (throughput is measured on these)."""

    def now(self) -> float:
        return self.t

    # ---- time ------------------------------------------------------------------------------------
    def _contention(self) -> float:
        """Time-slicing factor of a busy process when all ranks share `shared_cores` CPU cores."""
        if not self.cfg.shared_cores:
            return 1.0
        busy = sum(1 for i in self.insts if i.running or i.waiting or i.syncing) + (self.t < self.train_until)
        return max(1.0, busy / self.cfg.shared_cores)

    def poll(self, until: float):
        advanced = until > self.t
        if advanced:
            c = self._contention()
            for inst in self.insts:
                inst.contention = c
                finished, pulled = inst.advance(until)
                self.pending.extend(PullDone(inst.instance, v, self.pull_time) for v in pulled)
                for tr in finished:
                    t0, _, newest = self.first_route.get(tr.traj_id, (tr.t_done, -1.0, 0))
                    self.first_route[tr.traj_id] = (t0, tr.t_done, newest)
                    if tr.plan is not None:
                        self.wall.append(tr.t_done - t0)
                    self.pending.append(
                        Finished(tr.traj_id, inst.instance, self._record(tr, inst.instance), tr.generated)
                    )
            self.t = until
            while self.timers and self.timers[0][0] <= until:
                self.pending.append(heapq.heappop(self.timers)[2])
        while self.pending:
            yield self.pending.popleft()
        if advanced:
            dt = self.cfg.tick_s
            for inst in self.insts:
                tps = (inst.tokens_out - self._last_tokens[inst.instance]) / dt
                self._last_tokens[inst.instance] = inst.tokens_out
                yield InstanceSnapshot(
                    inst.instance,
                    inst.version,
                    len(inst.running),
                    len(inst.waiting),
                    inst.kv,
                    self.cost.kv_capacity,
                    tps,
                    inst.syncing,
                    self.t,
                    tokens_generated=inst.tokens_out,
                    parked_ids=inst.parked_ids(),
                )

    def _critical(self, batch: list[TrainGroup]) -> None:
        """The step's critical response, the trained one that finished last: its wall time (first route to
        finish) over its decode alone on the fastest instance (sim/floor.py alone_s), one token per step."""
        last = None
        for g in batch:
            for t, n in zip(g.traj_ids, g.n_tokens):
                t0, t1, _ = self.first_route.pop(t, (0.0, -1.0, 0))
                if t1 >= 0 and (last is None or t1 > last[0]):
                    last = (t1, t1 - t0, g.prompt_len, n)
        if last is not None and self.plans == {}:
            fast = min(i.speed for i in self.insts)
            alone = alone_s(self.cost, (last[2], last[3]), self.hw.prefill_tokens_per_s, fast)
            self.critical.append(last[1] / alone if alone > 0 else 0.0)

    def _at(self, t: float, event) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (t, self._seq, event))

    # ---- commands ----------------------------------------------------------------------------------
    def route(self, cmd: Route) -> None:
        """A loop-back resumes from its partial record's tokens (and recomputes their KV on admission)."""
        generated = cmd.partial.length if cmd.partial is not None else 0
        moved, version = self.kv_moved.pop(cmd.traj_id, (0, -1))
        plan = self.plans.get(cmd.seed) if self.plans else None
        if plan is not None:
            self.plan_of[cmd.traj_id] = plan
        self.first_route.setdefault(cmd.traj_id, (self.t, -1.0, 0))
        self.insts[cmd.instance].add(
            SimSequence(
                cmd.traj_id, cmd.traj_version, cmd.prompt_len, cmd.max_new_tokens, generated, moved, version, plan
            )
        )

    def interrupt(self, cmd: Interrupt) -> None:
        """A migrated trajectory that was running takes its KV along when the engine can move KV
        (hw.kv_move_tokens_per_s > 0): the source stalls while it offloads it. After a pull
        interrupt the KV is useless (the weights change), so it is dropped and recomputed later."""
        inst = self.insts[cmd.instance]
        for tr in inst.take(cmd.traj_ids, cmd.reason):
            if cmd.reason == "migrate" and tr.had_kv and inst.kv_rate > 0:
                self.kv_moved[tr.traj_id] = (tr.tokens, inst.version)
                inst.stall(self.t, tr.tokens * inst.speed / inst.kv_rate)
            self._loop_back(tr, cmd.instance)

    def _loop_back(self, tr: SimSequence, instance: int) -> None:
        """Report an interrupted trajectory's partial output (a loop-back)."""
        self.pending.append(Finished(tr.traj_id, instance, self._record(tr, instance), tr.generated, partial=True))

    def abort(self, cmd: Abort) -> None:
        self.insts[cmd.instance].take(cmd.traj_ids, "abort")
        for t in cmd.traj_ids:
            self.kv_moved.pop(t, None)
            self.first_route.pop(t, None)

    def pull(self, cmd: Pull) -> None:
        """A PS pull shares the PS egress with the pulls in flight (hw.pull_share); a broadcast does not."""
        dur = self.pull_time
        if self.sync == "ps" and self.hw.pull_share > 0:
            k = 1 + sum(1 for i in self.insts if i.syncing and i.sync_until > self.t)
            dur *= max(1.0, k * self.hw.pull_share)
        inst = self.insts[cmd.instance]
        if self.pull_interrupts:  # what still decodes or waits (the coordinator thought it parked) loops back
            for tr in inst.take([*inst.running, *(w.traj_id for w in inst.waiting)]):
                self._loop_back(tr, cmd.instance)
        inst.pull(cmd.version, self.t, dur, free_kv=self.pull_interrupts)

    def _record(self, tr: SimSequence, instance: int) -> RecordHandle:
        self.records += 1
        t0, t1, _ = self.first_route.get(tr.traj_id, (self.t, -1.0, 0))
        self.first_route[tr.traj_id] = (t0, t1, self.records)  # its newest record
        return sim_record(tr.traj_id, instance, tr.generated, self.records)

    def free(self, handles: list) -> None:
        """Simulated records take no memory. Freeing a trajectory's newest record (it was trained or dropped)
        forgets it: its KV in transit and its first route. An older record (the loop passes it back when a
        loop-back's newer one replaces it) changes nothing: the trajectory lives on, its moved KV and first route
        with it."""
        for h in handles:
            if self.first_route.get(h.offset, (0, 0, h.generation))[2] != h.generation:  # offset: the trajectory id
                continue
            self.kv_moved.pop(h.offset, None)
            self.first_route.pop(h.offset, None)

    def score(self, traj_id: int, handle, prompt) -> None:
        self.pending.append(Rewarded(traj_id, 1.0))  # rewards are instantaneous in the model

    def train(self, version: int, batch: list[TrainGroup]) -> None:
        cfg, hw = self.cfg, self.hw
        self._critical(batch)
        # linear FLOPs per token plus causal attention growing with each sequence's length squared
        tokens = sum(g.prompt_len + n + hw.train_attention * (g.prompt_len + n) ** 2 for g in batch for n in g.n_tokens)
        dur = tokens / (hw.train_tokens_per_gpu_s * self.train_gpus) + cfg.train_overhead_s
        dur *= math.exp(self.rng.gauss(0.0, cfg.train_noise)) if cfg.train_noise else 1.0
        if self.sync == "colocated":
            dur += hw.colocated_switch_s
        push = hw.push_s if self.sync == "ps" else 0.0
        if cfg.push_blocks_trainer:  # the push holds the trainer (PSRL's exclusive push lock), not overlapped
            dur, push = dur + push, 0.0
        publish = self.t + dur + push
        self.trainer_busy_s += dur
        self.train_durs.append(dur)
        self.train_until = self.t + dur
        self.step_end.append(publish)
        self._at(self.t + dur, TrainDone(version + 1, train_s=dur))
        if (version + 1) % self.publish_every == 0 or version + 1 >= cfg.steps:
            self._at(publish, Published(version + 1))
