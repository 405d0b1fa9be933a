"""Discrete-event run of one mode: the real Coordinator + StalenessManager against simulated parts.

``run(cfg, mode, eta, coordinator_overrides)`` advances simulated time in coordinator ticks of
``cfg.tick_s``: instances (sim/engine.py) decode until the tick's end, their finishes and pull
completions are fed to the coordinator, the trainer consumes Ready buffers (step time from a
token-based throughput model, then a weight push), fresh prompt groups keep the Trajectory
Server stocked, every instance sends a snapshot, and the tick's commands are executed. The run
also audits the protocol from outside: the V_traj carried by Route commands, the buffer each
group was consumed in, and the fate of every trajectory (consumed / aborted / live, never two).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass, field

from staleflow.coordinator.coordinator import Coordinator
from staleflow.coordinator.cost_model import CostModel, load_cost_model
from staleflow.coordinator.modes import COLOCATED, WEIGHT_SYNC, mode_overrides
from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull, Route, TrajectoryItem
from staleflow.protocol.staleness import StalenessManager
from staleflow.sim.config import SimConfig
from staleflow.sim.engine import SimInstance, SimTraj


@dataclass
class SimResult:
    mode: str
    eta: int
    label: str
    steps_done: int
    sim_time_s: float
    measured_s: float
    tokens: int
    samples: int
    tokens_per_s: float
    samples_per_s: float
    utilisation: list[float]
    staleness_hist: dict[int, int]
    pulls: int
    interrupts: int
    migrations: int
    aborts: dict[str, int]
    trainer_idle_frac: float
    preemptions: int
    violations: list[str] = field(default_factory=list)
    fates: dict[str, int] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)

    def row(self) -> dict:
        d = dataclasses.asdict(self)
        d["utilisation_mean"] = sum(self.utilisation) / max(1, len(self.utilisation))
        del d["utilisation"]
        return d


class LengthSampler:
    """Response lengths: lognormal(median, sigma) or an empirical file, capped at max_response."""

    def __init__(self, cfg: SimConfig, rng: random.Random):
        self.rng, self.cap = rng, cfg.max_response
        self.mu, self.sigma = math.log(cfg.response_median), cfg.response_sigma
        self.samples: list[int] = []
        if cfg.lengths_file:
            self.samples = read_lengths(cfg.lengths_file)

    def __call__(self) -> int:
        x = self.rng.choice(self.samples) if self.samples else self.rng.lognormvariate(self.mu, self.sigma)
        return max(1, min(self.cap, int(round(x))))


def read_lengths(path: str) -> list[int]:
    from staleflow.config import ConfigError

    try:
        lines = open(path).read().split()
    except OSError as e:
        raise ConfigError(f"--lengths-file={path!r} cannot be read ({e.strerror}); give a file of ints, one per line")
    out = []
    for i, tok in enumerate(lines, 1):
        try:
            v = int(tok)
        except ValueError:
            raise ConfigError(f"--lengths-file={path!r}: entry {i} is {tok!r}, not an int") from None
        if v < 1:
            raise ConfigError(f"--lengths-file={path!r}: entry {i} is {v}; lengths must be >= 1")
        out.append(v)
    if not out:
        raise ConfigError(f"--lengths-file={path!r} is empty; give one response length per line")
    return out


class Simulation:
    def __init__(self, cfg: SimConfig, mode: str, eta: int, overrides: dict | None = None,
                 cost: CostModel | None = None, label: str = ""):
        self.cfg, self.mode = cfg, mode
        forced = mode_overrides(mode)["staleness"]
        self.eta = forced.get("eta", eta)
        self.label = label or f"{mode} eta={self.eta}"
        self.cost = cost or load_cost_model(cfg.cost_model)
        if cfg.prompt_len + 2 > self.cost.kv_capacity:
            raise ValueError(f"--prompt-len={cfg.prompt_len} does not fit the KV capacity {self.cost.kv_capacity}")
        self.colocated = COLOCATED[mode]
        self.sync = WEIGHT_SYNC[mode]
        self.pull_time = {"ps": cfg.pull_s, "broadcast": cfg.broadcast_s}.get(self.sync, 0.0)
        gpus = cfg.total_gpus if self.colocated else cfg.rollout_gpus
        self.n_inst = max(1, gpus // cfg.gpus_per_instance)
        self.train_gpus = cfg.total_gpus if self.colocated else cfg.total_gpus - cfg.rollout_gpus
        red = mode == "staleflow"
        self.B, self.N = cfg.batch_size, cfg.group_size
        self.Bp = self.B + (cfg.batch_redundancy if red else 0)
        self.Np = self.N + (cfg.group_redundancy if red else 0)
        self.manager = StalenessManager(self.eta, self.B, self.Bp, self.N, self.Np)
        ccfg = dataclasses.replace(cfg.coordinator, **(overrides or {}))
        self.now = 0.0
        self.coord = Coordinator(ccfg, self.cost, self.manager, range(self.n_inst), mode,
                                 straggler=cfg.straggler if red else "off", straggler_threshold=cfg.straggler_threshold,
                                 clock=lambda: self.now)
        pre = cfg.prefill_tokens_per_s
        self.insts = [SimInstance(i, self.cost, pre, cfg.max_running) for i in range(self.n_inst)]
        self.rng = random.Random(cfg.seed)
        self.lengths = LengthSampler(cfg, self.rng)
        self.next_id = 0
        self.next_group = 0
        self.trajs: dict[int, SimTraj] = {}  # live trajectories (payload side, like the TS)
        self.group_tag: dict[int, int] = {}
        self.finished_members: dict[int, list[int]] = {}
        self.fate: dict[int, str] = {}
        self.violations: list[str] = []
        self.new_groups_queued = 0
        self.trainer_busy_until: float | None = None
        self.trainer_version = 0
        self.trainer_busy_s = 0.0
        self.publish_at: list[tuple[float, int]] = []
        self.step_end: list[float] = []
        self.step_tokens: list[int] = []
        self.step_samples: list[int] = []
        self.stale = Counter()

    # ---- workload --------------------------------------------------------------------------
    def _new_group(self) -> None:
        gid = self.next_group
        self.next_group += 1
        items = []
        for _ in range(self.Np):
            tid = self.next_id
            self.next_id += 1
            self.trajs[tid] = SimTraj(tid, gid, -1, self.cfg.prompt_len, self.lengths())
            self.fate[tid] = "live"
            items.append(TrajectoryItem(tid, gid, None, self.cfg.prompt_len))
        self.finished_members[gid] = []
        self.coord.submit(items)

    def _stock(self) -> None:
        """Keep enough fresh groups in the TS that admission, not supply, limits the rollout."""
        fresh = sum(1 for g in self.finished_members if g not in self.group_tag)
        for _ in range(max(0, 2 * (self.eta + 1) * self.Bp - fresh)):
            self._new_group()

    # ---- trainer ---------------------------------------------------------------------------
    def _trainer(self) -> None:
        cfg = self.cfg
        while self.publish_at and self.publish_at[0][0] <= self.now:
            _, v = self.publish_at.pop(0)
            self.coord.on_new_version(v)
        if self.trainer_busy_until is not None:
            if self.now < self.trainer_busy_until:
                return
            self.trainer_busy_until = None
        v = self.manager.ready_version()
        if v is None or len(self.step_end) >= cfg.steps:
            return
        gids = self.manager.consume(v)
        self.progress_at = self.now
        tokens = samples = train_tokens = 0
        for gid in gids:
            tag = self.group_tag.get(gid)
            if tag is None or not (tag <= v <= tag + self.eta):
                self.violations.append(f"group {gid} V_traj {tag} consumed in buffer {v} (eta {self.eta})")
            self.stale[v - (tag if tag is not None else v)] += 1
            for tid in self.finished_members.pop(gid):
                tr = self.trajs.pop(tid)
                if self.fate.get(tid) != "finished":
                    self.violations.append(f"trajectory {tid} consumed while {self.fate.get(tid)}")
                self.fate[tid] = "consumed"
                tokens += tr.target_len
                train_tokens += tr.prompt_len + tr.target_len
                samples += 1
            self.group_tag.pop(gid, None)
        dur = train_tokens / (cfg.train_tokens_per_gpu_s * self.train_gpus) + cfg.train_overhead_s
        if self.sync == "colocated":
            dur += cfg.colocated_switch_s
            publish = self.now + dur
        elif self.sync == "broadcast-pause":  # trainer and every instance stop for the broadcast
            for inst in self.insts:
                inst.pause = (self.now + dur, self.now + dur + cfg.broadcast_s)
            dur += cfg.broadcast_s
            publish = self.now + dur
        elif self.sync == "broadcast":  # paid by the instances at the batch boundary (pull_time)
            publish = self.now + dur
        else:  # ps: push to the Parameter Server, instances pull on their own
            publish = self.now + dur + cfg.push_s
        self.trainer_busy_until = self.now + dur
        self.trainer_busy_s += dur
        self.publish_at.append((publish, v + 1))
        self.step_end.append(publish)
        self.step_tokens.append(tokens)
        self.step_samples.append(samples)

    # ---- commands --------------------------------------------------------------------------
    def _execute(self, cmds) -> None:
        cfg = self.cfg
        for c in cmds:
            if isinstance(c, Route):
                tr = self.trajs[c.traj_id]
                tag = self.group_tag.setdefault(tr.group_id, c.traj_version)
                if tag != c.traj_version:
                    self.violations.append(f"group {tr.group_id} routed with V_traj {c.traj_version} after {tag}")
                tr.traj_version = c.traj_version
                self.insts[c.instance].add(tr)
            elif isinstance(c, Interrupt):
                self._interrupt(c)
            elif isinstance(c, Pull):
                self.insts[c.instance].pull(c.version, self.now, self.pull_time)
            elif isinstance(c, Abort):
                self._abort(c)

    def _interrupt(self, c: Interrupt) -> None:
        if c.instance >= 0:
            got = self.insts[c.instance].take(c.traj_ids)
        else:
            got = [self.trajs[t] for t in c.traj_ids]
        if c.reason == "truncate":
            for tr in got:
                tr.target_len = max(1, tr.generated)
                self._finish(c.instance, tr)
            return
        items = [TrajectoryItem(tr.traj_id, tr.group_id, tr.traj_version, tr.prompt_len, tr.generated, c.instance)
                 for tr in got]
        self.coord.on_interrupted(c.instance, items)

    def _abort(self, c: Abort) -> None:
        if c.instance >= 0:
            self.insts[c.instance].take(c.traj_ids)
        for t in c.traj_ids:
            if self.fate.get(t) not in ("live", "finished"):
                self.violations.append(f"abort of trajectory {t} which is {self.fate.get(t)}")
            self.fate[t] = "aborted"
            self.trajs.pop(t, None)
        if c.group_id >= 0:
            for t in self.finished_members.pop(c.group_id, []):
                self.fate[t] = "aborted"
                self.trajs.pop(t, None)
            self.group_tag.pop(c.group_id, None)
            if c.retry:
                self._new_group()

    def _finish(self, instance: int, tr: SimTraj) -> None:
        if self.fate.get(tr.traj_id) != "live" or tr.traj_id not in self.coord.items:
            return  # already aborted (the Abort is on its way): a late finish is dropped
        self.fate[tr.traj_id] = "finished"
        self.progress_at = self.now
        self.finished_members[tr.group_id].append(tr.traj_id)
        for gid in self.coord.on_finished(instance, tr.traj_id):
            self.coord.on_rewarded(gid)  # reward is instantaneous in the simulation

    # ---- main loop -------------------------------------------------------------------------
    def run(self) -> SimResult:
        cfg = self.cfg
        self._stock()
        last_tokens = [0] * self.n_inst
        self.progress_at = 0.0
        stall = 2000 * cfg.tick_s
        while len(self.step_end) < cfg.steps or self.now < self.step_end[-1]:
            if self.now > cfg.max_sim_s or self.now - self.progress_at > stall:
                self.violations.append(f"incomplete: no trajectory finished and no step ran for {stall:.0f} s "
                                       f"(stalled at t={self.now:.0f}s)" if self.now <= cfg.max_sim_s else
                                       f"incomplete: max-sim-s {cfg.max_sim_s:.0f} reached")
                break
            self.now += cfg.tick_s
            for inst in self.insts:
                finished, pulled = inst.advance(self.now)
                for v in pulled:
                    self.coord.on_pull_done(inst.instance, v)
                for tr in finished:
                    self._finish(inst.instance, tr)
            self._trainer()
            self._stock()
            for inst in self.insts:
                tps = (inst.tokens_out - last_tokens[inst.instance]) / cfg.tick_s
                last_tokens[inst.instance] = inst.tokens_out
                self.coord.on_snapshot(InstanceSnapshot(
                    inst.instance, inst.version, len(inst.running), len(inst.waiting), inst.kv,
                    self.cost.kv_capacity, tps, inst.syncing, self.now))
            self._execute(self.coord.tick(self.now))
        return self._result()

    def _result(self) -> SimResult:
        cfg = self.cfg
        done = len(self.step_end)
        w = cfg.warmup_steps
        if done > w:
            t0 = self.step_end[w - 1] if w > 0 else 0.0
            measured = self.step_end[-1] - t0
            tokens, samples = sum(self.step_tokens[w:]), sum(self.step_samples[w:])
        else:
            measured, tokens, samples = 0.0, 0, 0
        end = self.step_end[-1] if self.step_end else self.now
        c = self.coord.counters
        aborts = {k[len("aborted_"):]: v for k, v in c.items() if k.startswith("aborted_")}
        fates = Counter(self.fate.values())
        if done < cfg.steps:
            self.violations.append(f"incomplete: {done}/{cfg.steps} steps")
        return SimResult(
            mode=self.mode, eta=self.eta, label=self.label, steps_done=done, sim_time_s=end, measured_s=measured,
            tokens=tokens, samples=samples, tokens_per_s=tokens / measured if measured > 0 else 0.0,
            samples_per_s=samples / measured if measured > 0 else 0.0,
            utilisation=[min(1.0, i.busy_s / end) if end > 0 else 0.0 for i in self.insts],
            staleness_hist=dict(sorted(self.stale.items())), pulls=c["pulls"], interrupts=c["interrupted"],
            migrations=c["migrations"], aborts=aborts,
            trainer_idle_frac=1.0 - min(1.0, self.trainer_busy_s / end) if end > 0 else 1.0,
            preemptions=sum(i.preemptions for i in self.insts), violations=self.violations, fates=dict(fates),
            step_times=[b - a for a, b in zip([0.0] + self.step_end[:-1], self.step_end)])


def run(cfg: SimConfig, mode: str, eta: int, overrides: dict | None = None, label: str = "") -> SimResult:
    return Simulation(cfg, mode, eta, overrides, label=label).run()

