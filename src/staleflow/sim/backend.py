"""The controller loop's Backend for the simulator: instances, trainer and weights as a discrete-event model.

Simulated time advances in the loop's ticks (``poll(until)``): every instance decodes until
``until`` (sim/engine.py: continuous batching whose step time follows the cost model), its
finishes and completed pulls become events, the trainer's timers fire (a step's end, then the
publication of its weights), rewards are instantaneous, and every instance reports a snapshot.
Commands act at once: a Route adds the trajectory to the instance's waiting queue, an Interrupt
returns its partial output (a loop-back), a Pull stops decoding for the pull time.

How weights reach the instances depends on the system being modelled (coordinator/modes.py
WEIGHT_SYNC): ``ps`` the trainer pushes to the Parameter Server and each instance pulls on its
own; ``broadcast-pause`` every instance and the trainer stop for a broadcast; ``broadcast`` the
instances pay it at the batch boundary; ``colocated`` rollout and training share the GPUs.
"""

from __future__ import annotations

import heapq
from collections import deque

from staleflow.controller.backend import Finished, PullDone, Published, Rewarded, TrainDone, TrainGroup
from staleflow.coordinator.cost_model import CostModel
from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull, Route
from staleflow.sim.config import SimConfig
from staleflow.sim.engine import SimInstance, SimTraj


class SimRecord(tuple):
    """The simulator's stand-in for a record handle: (traj_id, tokens generated)."""


class SimBackend:
    def __init__(self, cfg: SimConfig, cost: CostModel, n_instances: int, train_gpus: int, weight_sync: str):
        self.cfg, self.cost, self.train_gpus, self.sync = cfg, cost, train_gpus, weight_sync
        self.pull_time = {"ps": cfg.pull_s, "broadcast": cfg.broadcast_s}.get(weight_sync, 0.0)
        self.insts = [SimInstance(i, cost, cfg.prefill_tokens_per_s, cfg.max_running) for i in range(n_instances)]
        self.t = 0.0
        self.pending: deque = deque()
        self.timers: list[tuple[float, int, object]] = []
        self._seq = 0
        self._last_tokens = [0] * n_instances
        self.trainer_busy_s = 0.0
        self.step_end: list[float] = []
        """Exact publication time of each trained version (throughput is measured on these)."""

    def now(self) -> float:
        return self.t

    # ---- time ------------------------------------------------------------------------------------
    def poll(self, until: float):
        advanced = until > self.t
        if advanced:
            for inst in self.insts:
                finished, pulled = inst.advance(until)
                self.pending.extend(PullDone(inst.instance, v, self.pull_time) for v in pulled)
                for tr in finished:
                    self.pending.append(Finished(tr.traj_id, inst.instance, SimRecord((tr.traj_id, tr.generated)),
                                                 tr.generated))
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
                yield InstanceSnapshot(inst.instance, inst.version, len(inst.running), len(inst.waiting), inst.kv,
                                       self.cost.kv_capacity, tps, inst.syncing, self.t,
                                       tokens_generated=inst.tokens_out)

    def _at(self, t: float, event) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (t, self._seq, event))

    # ---- commands ----------------------------------------------------------------------------------
    def route(self, cmd: Route, prompt_len: int, seed: int, partial, target_len: int) -> None:
        """A loop-back resumes from its partial record's tokens (and recomputes their KV on admission)."""
        generated = partial[1] if partial is not None else 0
        self.insts[cmd.instance].add(SimTraj(cmd.traj_id, -1, cmd.traj_version, prompt_len, target_len, generated))

    def interrupt(self, cmd: Interrupt) -> None:
        for tr in self.insts[cmd.instance].take(cmd.traj_ids):
            self.pending.append(Finished(tr.traj_id, cmd.instance, SimRecord((tr.traj_id, tr.generated)),
                                         tr.generated, partial=True))

    def abort(self, cmd: Abort) -> None:
        self.insts[cmd.instance].take(cmd.traj_ids)

    def pull(self, cmd: Pull) -> None:
        self.insts[cmd.instance].pull(cmd.version, self.t, self.pull_time)

    def free(self, handles: list) -> None:
        """Simulated records take no memory."""

    def score(self, traj_id: int, handle, prompt) -> None:
        self.pending.append(Rewarded(traj_id, 1.0))  # rewards are instantaneous in the model

    def train(self, version: int, batch: list[TrainGroup]) -> None:
        cfg = self.cfg
        tokens = sum(g.prompt_len * len(g.n_tokens) + sum(g.n_tokens) for g in batch)
        dur = tokens / (cfg.train_tokens_per_gpu_s * self.train_gpus) + cfg.train_overhead_s
        if self.sync == "colocated":
            dur += cfg.colocated_switch_s
            publish = self.t + dur
        elif self.sync == "broadcast-pause":  # trainer and every instance stop for the broadcast
            for inst in self.insts:
                inst.pause = (self.t + dur, self.t + dur + cfg.broadcast_s)
            dur += cfg.broadcast_s
            publish = self.t + dur
        elif self.sync == "broadcast":  # paid by the instances at the batch boundary (pull_time)
            publish = self.t + dur
        else:  # ps: push to the Parameter Server, instances pull on their own
            publish = self.t + dur + cfg.push_s
        self.trainer_busy_s += dur
        self.step_end.append(publish)
        self._at(self.t + dur, TrainDone(version + 1, train_s=dur))
        self._at(publish, Published(version + 1))
