"""A simulated rollout instance: continuous batching whose decode step time follows the cost model.

Per decode step every running trajectory gains one token and the step takes
``cost.step_time(n, KV)``; between events (a trajectory finishing, the KV cache filling up, the
end of the coordinator tick) n is constant and KV grows by n per step, so ``advance`` jumps
whole stretches of steps in closed form (CostModel.steps_time / steps_within) instead of
simulating tokens one by one. Admission from the engine's waiting queue needs a free running
slot and KV room, and costs prefill time (prompt + already generated tokens: a resumed partial
trajectory recomputes its KV). When growth would overflow the KV cache the newest running
trajectory is preempted back to the waiting queue (vLLM's recompute preemption). A migrated
trajectory whose KV moved with it (``kv_moved``) loads that KV at the KV-transfer rate instead of
prefilling it, if the KV was computed with this instance's weights (or in-flight weight updates are
on, ``mixed_kv``: then old-weight KV is used as the keep-KV pull uses it).
A Pull stops decoding for its transfer time and then switches the version (a global update is
every instance pulling at once: the coordinator's pause-all policy).

Noise: the instance is ``speed`` times slower than the cost model (a fixed per-instance factor:
hardware and placement differ), and each stretch of decode steps (at most one coordinator tick)
takes exp(N(0, noise)) longer or shorter (interference, kernel-time jitter); prefill scales by
``speed`` too. The coordinator never sees these factors, only their effect in snapshots.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque

from staleflow.coordinator.cost_model import CostModel


class SimSequence:
    """The simulated engine's own state of one sequence it holds (as rollout/sequence.py's Sequence is
    the real engine's): what it was routed with (V_traj, to check the instance's version; prompt and
    generated lengths; the length it will reach) and where its decoding stands (KV start, finish
    step, moved KV). Created from a Route, gone when it finishes or is taken off; the trajectory's
    record (reward, fate, handle) is the controller ledger's."""

    __slots__ = (
        "traj_id",
        "traj_version",
        "prompt_len",
        "target_len",
        "generated",
        "tok0",
        "finish_step",
        "had_kv",
        "kv_moved",
        "kv_version",
    )

    def __init__(
        self,
        traj_id: int,
        traj_version: int,
        prompt_len: int,
        target_len: int,
        generated: int = 0,
        kv_moved: int = 0,
        kv_version: int = -1,
    ):
        self.traj_id, self.traj_version = traj_id, traj_version
        self.prompt_len, self.target_len, self.generated = prompt_len, target_len, generated
        self.tok0 = 0  # KV tokens minus the instance step counter at admission
        self.finish_step = 0
        self.had_kv = False  # set by take(): it was running (its KV was resident), not queued in the engine
        self.kv_moved = kv_moved  # KV tokens that arrive by transfer (a KV-moving migration) instead of prefill
        self.kv_version = kv_version  # weight version the moved KV was computed with

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.generated


class SimInstance:
    def __init__(
        self,
        instance: int,
        cost: CostModel,
        prefill_tokens_per_s: float,
        max_running: int,
        speed: float = 1.0,
        noise: float = 0.0,
        rng: random.Random | None = None,
        kv_move_tokens_per_s: float = 0.0,
        mixed_kv: bool = False,
        chunk_tokens: int = 0,
    ):
        self.instance, self.cost = instance, cost
        self.kv_rate = kv_move_tokens_per_s
        self.mixed_kv = mixed_kv
        """Moved KV computed with older weights may be used (in-flight weight updates are on: keep_kv_on_pull)."""
        self.speed, self.noise, self.rng = speed, noise, rng or random.Random(instance)
        self.contention = 1.0  # > 1 while it shares CPU cores with other busy processes (set per tick)
        self.prefill_rate, self.max_running = prefill_tokens_per_s, max_running
        self.version = 0
        self.t = 0.0
        self.step = 0  # decode steps done since start
        self.running: dict[int, SimSequence] = {}
        self.heap: list[tuple[int, int]] = []  # (finish_step, traj_id), lazy deletion
        self.waiting: deque[SimSequence] = deque()
        self.kv_const = 0  # sum of tok0 over running: KV = kv_const + n * step
        self.sync_until: float | None = None
        self.sync_version = 0
        self.tokens_out = 0
        self.busy_s = 0.0
        self.preemptions = 0
        self.chunk_tokens = chunk_tokens
        """Chunked prefill (vLLM max_num_batched_tokens): prefill rides along decode steps, each step carrying
        up to chunk_tokens - n prefill tokens, instead of stopping decoding. 0: a prefill stops decoding."""
        self.prefill_debt = 0.0  # seconds of admitted prefill not yet done (chunked prefill)
        self.min_version_seen = None  # smallest (instance version - V_traj) at admission, for checks

    # ---- state ---------------------------------------------------------------------------------
    @property
    def kv(self) -> int:
        return self.kv_const + len(self.running) * self.step

    @property
    def syncing(self) -> bool:
        return self.sync_until is not None

    def holds(self, traj_id: int) -> bool:
        return traj_id in self.running or any(w.traj_id == traj_id for w in self.waiting)

    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---- commands ------------------------------------------------------------------------------
    def add(self, traj: SimSequence) -> None:
        self.waiting.append(traj)

    def pull(self, version: int, now: float, pull_s: float) -> None:
        self.t = max(self.t, now)
        self.sync_until, self.sync_version = self.t + pull_s, version

    def stall(self, now: float, seconds: float) -> None:
        """Stop decoding for `seconds` from now (a KV offload of a migrated trajectory)."""
        self.t = max(self.t, now) + seconds
        self.busy_s += seconds

    def take(self, traj_ids) -> list[SimSequence]:
        """Remove trajectories (interrupt or abort); returns them with their generated count updated."""
        out = []
        want = set(traj_ids)
        for tid in want & self.running.keys():
            tr = self.running.pop(tid)
            tr.generated = tr.tok0 + self.step - tr.prompt_len
            tr.had_kv = True
            self.kv_const -= tr.tok0
            out.append(tr)
        if len(out) < len(want):
            keep = deque()
            for w in self.waiting:
                (out.append(w) if w.traj_id in want else keep.append(w))
            self.waiting = keep
        return out

    # ---- time ----------------------------------------------------------------------------------
    def _admit(self) -> float:
        """Start waiting trajectories that fit; returns the prefill seconds spent."""
        prefill = moved = 0
        cap = self.cost.kv_capacity
        while self.waiting and len(self.running) < self.max_running:
            w = self.waiting[0]
            if self.kv + w.tokens + len(self.running) + 1 > cap and self.running:
                break
            self.waiting.popleft()
            if self.version < w.traj_version:
                raise AssertionError(
                    f"instance {self.instance} at version {self.version} runs trajectory "
                    f"{w.traj_id} with V_traj {w.traj_version}"
                )
            w.tok0 = w.tokens - self.step
            w.finish_step = self.step + max(1, w.target_len - w.generated)
            self.running[w.traj_id] = w
            self.kv_const += w.tok0
            heapq.heappush(self.heap, (w.finish_step, w.traj_id))
            if w.kv_moved and self.kv_rate > 0 and (w.kv_version == self.version or self.mixed_kv):
                moved += w.kv_moved  # its KV arrives by transfer; only what it lacks is prefilled
                prefill += w.tokens - w.kv_moved
            else:
                prefill += w.tokens
            w.kv_moved = 0
        return (prefill / self.prefill_rate + (moved / self.kv_rate if moved else 0.0)) * self.speed * self.contention

    def _next_finish(self) -> int:
        h = self.heap
        while h and (h[0][1] not in self.running or self.running[h[0][1]].finish_step != h[0][0]):
            heapq.heappop(h)
        return h[0][0] if h else -1

    def advance(self, t_end: float) -> tuple[list[SimSequence], list[int]]:
        """Run until t_end; returns (finished trajectories, versions whose pull completed)."""
        finished: list[SimSequence] = []
        pulled: list[int] = []
        while self.t < t_end:
            if self.sync_until is not None:
                if self.sync_until > t_end:
                    self.t = t_end
                    break
                self.t = self.sync_until
                self.sync_until = None
                self.version = self.sync_version
                pulled.append(self.version)
                continue
            pre = self._admit()
            if pre > 0 and not self.chunk_tokens:
                self.t += pre
                self.busy_s += pre
                continue
            self.prefill_debt += pre
            n = len(self.running)
            if n == 0:
                if self.prefill_debt > 0:  # nothing to decode: the prefill runs alone
                    d = min(self.prefill_debt, t_end - self.t)
                    self.t += d
                    self.busy_s += d
                    self.prefill_debt -= d
                    continue
                self.t = t_end
                break
            kv = self.kv
            k_fin = self._next_finish() - self.step
            k_over = (self.cost.kv_capacity - kv) // n
            if k_over <= 0:  # KV full: preempt the newest running trajectory (recompute later)
                tid = next(reversed(self.running))
                self.waiting.appendleft(self.take([tid])[0])
                self.preemptions += 1
                continue
            f = self.speed * self.contention * (math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else 1.0)
            k_time = self.cost.steps_within(n, kv, (t_end - self.t) / f)
            k = min(k_fin, k_over, k_time)
            chunk = 0.0
            if self.prefill_debt > 0:  # each step carries a prefill chunk until the debt is paid
                chunk = max(1, self.chunk_tokens - n) * self.speed * self.contention / self.prefill_rate
                k = min(k, max(1, math.ceil(self.prefill_debt / chunk)))
                while k > 0 and self.cost.steps_time(n, kv, k) * f + min(self.prefill_debt, k * chunk) > t_end - self.t:
                    k = k // 2 if k > 1 else 0
            if k <= 0:
                break  # not even one step fits before t_end: carry the remainder to the next tick
            extra = min(self.prefill_debt, k * chunk)
            self.prefill_debt -= extra
            dt = self.cost.steps_time(n, kv, k) * f + extra
            self.t += dt
            self.busy_s += dt
            self.step += k
            self.tokens_out += n * k
            if k == k_fin:
                while self.heap and self._next_finish() == self.step:
                    _, tid = heapq.heappop(self.heap)
                    tr = self.running.pop(tid)
                    self.kv_const -= tr.tok0
                    tr.generated = tr.target_len
                    finished.append(tr)
        return finished, pulled
