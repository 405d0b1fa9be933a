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
every instance pulling at once: the coordinator's pause-all policy); with ``free_kv`` (partial rollout
without keep-KV) the KV of the sequences parked on a tool call is freed at the pull: they stay parked,
and when the call returns they prefill their prefix and the observation under the new version.

Turns (a sequence with a ``plan``, sim/turns.py): at the end of a turn the sequence is PARKED: it leaves
the running batch (no decoding, no running slot) and its KV stays resident (the built-in engine's hold),
counted in the instance's KV but not read by decode steps; when its tool call returns (after the call's
latency) it queues at the head of the waiting queue and, admitted, prefills only the observation. KV
overflow evicts the most recently parked sequence's KV first (it re-prefills its prefix when it resumes),
then preempts the newest running one. The coordinator interrupts no parked sequence at a pull and migrates
none (``parked_ids`` in the snapshot); one interrupted while parked anyway (an Interrupt sent before a
snapshot showed it parked) re-prefills its prefix and re-runs the unanswered call wherever it resumes
(``parked_taken`` counts these, and aborted ones, by reason).

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
        "plan",
        "wake",
        "resident",
        "obs_ready",
        "t_done",
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
        plan=None,
    ):
        self.traj_id, self.traj_version = traj_id, traj_version
        self.prompt_len, self.target_len, self.generated = prompt_len, target_len, generated
        self.tok0 = 0  # KV tokens minus the instance step counter at admission
        self.finish_step = 0
        self.had_kv = False  # set by take(): it was running (its KV was resident), not queued in the engine
        self.kv_moved = kv_moved  # KV tokens that arrive by transfer (a KV-moving migration) instead of prefill
        self.kv_version = kv_version  # weight version the moved KV was computed with
        self.plan = plan  # sim/turns.TurnPlan: tool calls between turns (None: one turn, no tools)
        self.wake = 0.0  # parked: when its tool call returns
        self.resident = False  # not running but its KV is held (parked, or woken and waiting for admission)
        self.obs_ready = False  # its pending tool call has returned: the observation is appended at admission
        self.t_done = -1.0  # simulated time it finished (all turns)

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
        spec: CostModel | None = None,
        spec_rows: int = 1,
        spec_accept: float = 1.0,
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
        self.kv_const = 0  # sum of tok0 over running: KV = kv_const + n * step (+ kv_held)
        self.held: dict[int, SimSequence] = {}  # not running, KV resident: parked on a tool call or woken
        self.kv_held = 0  # KV tokens of `held`
        self.parked: list[tuple[float, int]] = []  # (wake time, traj_id), lazy deletion
        self.tool_calls = 0  # tool calls returned (re-runs included)
        self.tool_s = 0.0  # seconds those calls took
        self.parked_taken: dict[str, int] = {}  # reason -> trajectories taken off while parked on a tool call
        self.sync_until: float | None = None
        self.sync_version = 0
        self.tokens_out = 0
        self.busy_s = 0.0
        self.preemptions = 0
        self.chunk_tokens = chunk_tokens
        """Chunked prefill (vLLM max_num_batched_tokens): prefill rides along decode steps, each step carrying
        up to chunk_tokens - n prefill tokens, instead of stopping decoding. 0: a prefill stops decoding."""
        self.prefill_debt = 0.0  # seconds of admitted prefill not yet done (chunked prefill)
        self.spec, self.spec_rows, self.spec_accept = spec, spec_rows, spec_accept
        """Speculative decoding (sim/speculative.py): the per-token cost of a verify forward over spec_rows
        positions per sequence yielding spec_accept tokens each, used in a stretch where it is cheaper than plain
        decoding; None: off."""
        self.spec_tokens = 0  # tokens decoded in speculative stretches
        self.min_version_seen = None  # smallest (instance version - V_traj) at admission, for checks

    # ---- state ---------------------------------------------------------------------------------
    @property
    def kv(self) -> int:
        """KV tokens resident: the running sequences' and the parked ones' (what capacity and snapshots see)."""
        return self.kv_const + len(self.running) * self.step + self.kv_held

    @property
    def kv_run(self) -> int:
        """KV tokens the decode step reads (the running sequences')."""
        return self.kv_const + len(self.running) * self.step

    @property
    def syncing(self) -> bool:
        return self.sync_until is not None

    def holds(self, traj_id: int) -> bool:
        return traj_id in self.running or traj_id in self.held or any(w.traj_id == traj_id for w in self.waiting)

    def load(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.parked_ids())

    def parked_ids(self) -> tuple[int, ...]:
        """Sequences parked on a tool call that has not returned (the snapshot's parked_ids)."""
        return tuple(tid for tid, s in self.held.items() if not s.obs_ready)

    # ---- commands ------------------------------------------------------------------------------
    def add(self, traj: SimSequence) -> None:
        self.waiting.append(traj)

    def pull(self, version: int, now: float, pull_s: float, free_kv: bool = False) -> None:
        """Load `version` for pull_s seconds. free_kv: the held sequences (parked on a tool call: the
        caller has taken the others) lose their KV, which came from the old weights."""
        self.t = max(self.t, now)
        self.sync_until, self.sync_version = self.t + pull_s, version
        if free_kv:
            for tr in self.held.values():
                self._evict(tr)

    def stall(self, now: float, seconds: float) -> None:
        """Stop decoding for `seconds` from now (a KV offload of a migrated trajectory)."""
        self.t = max(self.t, now) + seconds
        self.busy_s += seconds

    def take(self, traj_ids, reason: str = "preempt") -> list[SimSequence]:
        """Remove trajectories (interrupt or abort: the command's reason, or "abort"); returns them with their
        generated count updated."""
        out = []
        want = set(traj_ids)
        for tid in want & self.running.keys():
            tr = self.running.pop(tid)
            tr.generated = tr.tok0 + self.step - tr.prompt_len
            tr.had_kv = True
            self.kv_const -= tr.tok0
            out.append(tr)
        for tid in want & self.held.keys():  # parked (or woken and queued): its KV may be resident
            tr = self.held[tid]
            tr.had_kv = tr.resident
            self._unhold(tid)
            if not tr.obs_ready:  # still parked (a woken one is in the waiting queue, found below)
                out.append(tr)
                self.parked_taken[reason] = self.parked_taken.get(reason, 0) + 1
            else:  # woken: the call returned, its observation is in the record (the runtime's extend appended
                tr.generated += tr.plan.obs  # it at once): nothing is re-run where it resumes
                tr.had_kv = False  # its KV lacks the observation: it re-prefills, no KV move
        if len(out) < len(want):
            keep = deque()
            for w in self.waiting:
                (out.append(w) if w.traj_id in want else keep.append(w))
            self.waiting = keep
        for tr in out:
            tr.obs_ready = False  # a parked one's call is unanswered: re-run wherever it resumes
        return out

    def _unhold(self, traj_id: int) -> SimSequence:
        tr = self.held.pop(traj_id)
        self._evict(tr)
        return tr

    def _evict(self, tr: SimSequence) -> None:
        """Free a held sequence's KV (it re-prefills its prefix when admitted)."""
        if tr.resident:
            self.kv_held -= tr.tokens
            tr.resident = False

    def _park(self, tr: SimSequence, call: int) -> None:
        """`tr` issued tool call `call`: it stops decoding, keeps its KV and wakes when the call returns."""
        tr.resident, tr.obs_ready = True, False
        tr.wake = self.t + tr.plan.tool_s[call]
        self.held[tr.traj_id] = tr
        self.kv_held += tr.tokens
        heapq.heappush(self.parked, (tr.wake, tr.traj_id))

    def _wake(self) -> float:
        """Queue the sequences whose tool call has returned by now; returns the next wake time (inf: none)."""
        p = self.parked
        while p:
            wake, tid = p[0]
            tr = self.held.get(tid)
            if tr is None or tr.wake != wake or tr.obs_ready:
                heapq.heappop(p)  # taken off, re-parked or already woken
                continue
            if wake > self.t:
                return wake
            heapq.heappop(p)
            tr.obs_ready = True
            self.tool_calls += 1
            self.tool_s += tr.plan.tool_s[tr.plan.call_at(tr.generated)]
            self.waiting.appendleft(tr)  # its KV is held: it goes first
        return math.inf

    # ---- time ----------------------------------------------------------------------------------
    def _admit(self) -> float:
        """Start waiting trajectories that fit; returns the prefill seconds spent."""
        prefill = moved = 0
        cap = self.cost.kv_capacity
        while self.waiting and len(self.running) < self.max_running:
            w = self.waiting[0]
            plan = w.plan
            call = plan.call_at(w.generated) if plan is not None else -1
            obs = plan.obs if call >= 0 and w.obs_ready else 0
            need = obs if w.resident else w.tokens + obs
            if self.kv + need + len(self.running) + 1 > cap and self.running:
                break
            self.waiting.popleft()
            if self.version < w.traj_version:
                raise AssertionError(
                    f"instance {self.instance} at version {self.version} runs trajectory "
                    f"{w.traj_id} with V_traj {w.traj_version}"
                )
            if w.resident:  # its tool call returned: only the observation is prefilled (the engine's extend)
                self._unhold(w.traj_id)
                w.generated += obs
                w.obs_ready = False
                prefill += obs
            else:
                self.held.pop(w.traj_id, None)  # (a woken sequence whose KV was evicted)
                if obs:  # a woken sequence whose KV was evicted: the observation is prefilled with its prefix
                    w.generated += obs
                    w.obs_ready = False
                if w.kv_moved and self.kv_rate > 0 and (w.kv_version == self.version or self.mixed_kv):
                    moved += w.kv_moved  # its KV arrives by transfer; only what it lacks is prefilled
                    prefill += w.tokens - w.kv_moved
                else:
                    prefill += w.tokens
                w.kv_moved = 0
                if call >= 0 and not obs:  # resumed at an unanswered tool call: it re-runs the call, KV held
                    self._park(w, call)
                    continue
            w.tok0 = w.tokens - self.step
            stop = plan.next_stop(w.generated) if plan is not None else w.target_len
            w.finish_step = self.step + max(1, stop - w.generated)
            self.running[w.traj_id] = w
            self.kv_const += w.tok0
            heapq.heappush(self.heap, (w.finish_step, w.traj_id))
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
            nxt = self._wake() if self.parked else math.inf  # the next tool call to return
            lim = min(t_end, nxt)
            pre = self._admit()
            if pre > 0 and not self.chunk_tokens:
                self.t += pre
                self.busy_s += pre
                continue
            self.prefill_debt += pre
            n = len(self.running)
            if n == 0:
                if self.prefill_debt > 0:  # nothing to decode: the prefill runs alone
                    d = min(self.prefill_debt, lim - self.t)
                    self.t += d
                    self.busy_s += d
                    self.prefill_debt -= d
                    continue
                if nxt < t_end:  # idle until a tool call returns
                    self.t = nxt
                    continue
                self.t = t_end
                break
            kv = self.kv_run
            cost, accept = self.cost, 1.0
            if self.spec is not None and self.spec.step_time(n, kv) < cost.step_time(n, kv):
                cost, accept = self.spec, self.spec_accept  # a verify forward pays where it is cheaper
            k_fin = self._next_finish() - self.step
            k_over = (self.cost.kv_capacity - kv - self.kv_held) // n
            if k_over <= 0 and self.kv_held:  # KV full: evict the most recently parked sequence's KV first
                self._evict(next(s for s in reversed(self.held.values()) if s.resident))
                self.preemptions += 1
                continue
            if k_over <= 0:  # KV full: preempt the newest running trajectory (recompute later)
                tid = next(reversed(self.running))
                self.waiting.appendleft(self.take([tid])[0])
                self.preemptions += 1
                continue
            f = self.speed * self.contention * (math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else 1.0)
            k_time = cost.steps_within(n, kv, (lim - self.t) / f)
            if k_time <= 0 and lim < t_end:  # a step overruns the next tool return: take it anyway
                k_time = min(1, cost.steps_within(n, kv, (t_end - self.t) / f))
            k = min(k_fin, k_over, k_time)
            chunk = 0.0
            if self.prefill_debt > 0:  # each forward carries a prefill chunk until the debt is paid
                rows = n * (self.spec_rows if cost is self.spec else 1)
                chunk = max(1, self.chunk_tokens - rows) / accept * self.speed * self.contention / self.prefill_rate
                k = min(k, max(1, math.ceil(self.prefill_debt / chunk)))
                while k > 0 and cost.steps_time(n, kv, k) * f + min(self.prefill_debt, k * chunk) > t_end - self.t:
                    k = k // 2 if k > 1 else 0
            if k <= 0:
                break  # not even one step fits before t_end: carry the remainder to the next tick
            extra = min(self.prefill_debt, k * chunk)
            self.prefill_debt -= extra
            dt = cost.steps_time(n, kv, k) * f + extra
            self.t += dt
            self.busy_s += dt
            self.step += k
            self.tokens_out += n * k
            if cost is self.spec:
                self.spec_tokens += n * k
            if k == k_fin:
                while self.heap and self._next_finish() == self.step:
                    _, tid = heapq.heappop(self.heap)
                    tr = self.running.pop(tid)
                    self.kv_const -= tr.tok0
                    pos = tr.tok0 + self.step - tr.prompt_len
                    if tr.plan is not None and pos < tr.plan.total:  # a turn ended: its tool call runs
                        tr.generated = pos
                        self._park(tr, tr.plan.call_at(pos))
                        continue
                    tr.generated = tr.target_len
                    tr.t_done = self.t
                    finished.append(tr)
        return finished, pulled
