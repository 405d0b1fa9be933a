"""Discrete-event run of one mode: the shared controller loop against the simulated backend.

``run(cfg, mode, eta, coordinator_overrides)`` builds what the real controller builds (the
mode's batch protocol, the Coordinator with the mode resolved once, the Ledger and the
ControllerLoop of staleflow.controller) and drives it over ``SimBackend`` (sim/backend.py):
simulated instances, trainer and weight transfers. The router does not see the instances' true
cost model: it gets one FITTED to noisy profiling samples of them (``router_cost_model``), as a
real deployment fits its coefficients offline. The loop audits the protocol from outside as in
the runtime (the V_traj carried by Route commands, the bound of every trained group, the fate of
every trajectory); the result adds the simulated throughput, utilisation and, for the peers
without a per-trajectory bound, how many trained groups exceeded eta.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass, field

from staleflow.controller import ControllerLoop, Stalled
from staleflow.controller.build import build_loop
from staleflow.coordinator.cost_model import CostModel, fit_cost_model, load_cost_model
from staleflow.modes import apply_mode, check_mode, mode_of, mode_settings
from staleflow.sim.backend import SimBackend
from staleflow.sim.config import SimConfig
from staleflow.sim.floor import Floor, physical_floor
from staleflow.sim.hardware import derive, profile_cost
from staleflow.sim.lengths import LengthSampler
from staleflow.sim.turns import TurnSampler


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
    over_eta: int = 0
    """Trained groups with staleness > eta (only possible for the peers: no per-trajectory bound)."""
    train_s_mean: float = 0.0
    """Mean seconds the trainer spent per step (training only)."""
    violations: list[str] = field(default_factory=list)
    fates: dict[str, int] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    fastest_speed: float = 1.0
    """Smallest per-instance speed factor (< 1: faster than the cost model); the tail floor uses it."""
    longest: list[int] = field(default_factory=list)
    """Longest response trained in each step."""
    floor: Floor | None = None
    """The run's physical floor (sim/floor.py) over its measured steps."""
    step_s: float = 0.0
    """Mean step time over the measured steps (seconds)."""
    tool_calls: int = 0
    """Tool calls that returned (multi-turn workloads; re-runs after an interrupt included)."""
    tool_s_mean: float = 0.0
    """Mean seconds of those calls."""
    wall_p50: float = 0.0
    """Median seconds from a multi-turn trajectory's first route to its finish (tool waits included)."""
    wall_p99: float = 0.0
    """99th percentile of the same."""
    critical_slowdown: float = 0.0
    """Mean over the measured steps of the critical response's wall time (first route to finish; the trained
    response that finished last) over its decode alone on the fastest instance, one token per step."""
    spec_frac: float = 0.0
    """Fraction of the decoded tokens decoded speculatively (sim/speculative.py)."""
    lanes: int = 0
    """Tail lanes opened (coordinator/lanes.py)."""
    parked_taken: dict[str, int] = field(default_factory=dict)
    """Trajectories taken off an instance while parked on a tool call, by reason (pull, migrate: an Interrupt,
    whose trajectory re-runs the call where it resumes; truncate: its partial output is final; abort: dropped)."""

    def row(self) -> dict:
        d = dataclasses.asdict(self)
        d["utilisation_mean"] = sum(self.utilisation) / max(1, len(self.utilisation))
        del d["utilisation"]
        d["floor"] = self.floor.row() if self.floor else None
        return d


def read_lengths(path: str) -> list[int]:
    from staleflow.config import ConfigError

    try:
        lines = open(path).read().split()
    except OSError as e:
        raise ConfigError(
            f"--lengths-file={path!r} cannot be read ({e.strerror}); give a file of ints, one per line"
        ) from None
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


class SimWorkload:
    """Prompts of a fixed length; response lengths drawn per trajectory (the model does not decide).
    A prompt's draws (difficulty, length scale) apply to the members drawn after it (the loop draws a
    group's members right after its prompt)."""

    def __init__(self, cfg: SimConfig, rng: random.Random):
        self.prompt = cfg.prompt_len
        samples = read_lengths(cfg.lengths_file) if cfg.lengths_file else None
        self.lengths = LengthSampler(
            cfg.length_dist, cfg.response_median, cfg.response_sigma, cfg.max_response, rng, samples
        )
        self.rng = rng
        self.turns = None
        self.plans: dict = {}
        """seed -> TurnPlan of each member drawn (multi-turn workloads; the seed is the plan's id)."""
        if cfg.tool_calls_max > 0:
            self.turns = TurnSampler(
                cfg.tool_calls_min,
                cfg.tool_calls_max,
                cfg.tool_latency_median_s,
                cfg.tool_latency_p99_s,
                cfg.tool_obs_tokens,
                random.Random(cfg.seed * 104729 + 3),
            )

    def next_prompt(self) -> int:
        self.lengths.new_prompt()
        return self.prompt

    def prompt_len(self, prompt: int) -> int:
        return prompt

    def prompt_ids(self, prompt: int) -> list[int]:
        return []  # simulated prompts have a length, not tokens

    def env_fields(self, prompt: int) -> dict:
        return {}  # simulated trajectories have no data row

    def new_member(self) -> tuple[int, int]:
        """(seed, target length): single-turn (0, model tokens); multi-turn (the plan's id, model + observation
        tokens), the plan drawn from the model tokens (sim/turns.py)."""
        n = self.lengths()
        if self.turns is None:
            return 0, n
        plan = self.turns(n)
        seed = len(self.plans) + 1
        self.plans[seed] = plan
        return seed, plan.total


def router_cost_model(true: CostModel, cfg: SimConfig, rng: random.Random) -> CostModel:
    """What the coordinator believes: the cost model fitted to `router_fit_samples` noisy decode-step
    times of the simulated instances over the (n, KV) range they run in (0 samples: the truth)."""
    if cfg.router_fit_samples <= 0:
        return true
    samples = []
    for _ in range(cfg.router_fit_samples):
        n = max(1, int(round(math.exp(rng.uniform(0.0, math.log(cfg.max_running))))))
        kv = rng.uniform(0.0, 1.0) * true.kv_capacity
        samples.append((n, kv, true.step_time(n, kv) * math.exp(rng.gauss(0.0, cfg.router_fit_noise))))
    return fit_cost_model(
        samples,
        true.kv_capacity,
        name=f"{true.name}-fitted",
        source=f"{len(samples)} noisy samples of the simulated instances",
    )


def stall_s(cfg: SimConfig, hw, train_gpus: int, stale) -> float:
    """Seconds without a finished trajectory or a step after which a run counts as stalled: 2000 ticks,
    or three worst-case training steps (every response at the cap) where the trainer is that slow."""
    worst_train = (
        stale.batch_size
        * stale.group_size
        * (cfg.prompt_len + cfg.max_response + cfg.tool_calls_max * cfg.tool_obs_tokens)
    )
    return max(2000 * cfg.tick_s, 3.0 * worst_train / (hw.train_tokens_per_gpu_s * train_gpus))


def build(
    cfg: SimConfig,
    mode: str,
    eta: int,
    overrides: dict | None = None,
    cost: CostModel | None = None,
    label: str = "",
    peer: dict | None = None,
):
    """(loop, backend, resolved staleness config) of one simulated run, built like the runtime's.

    `overrides` (coordinator fields) are applied AFTER the mode, so the caller's value wins over the
    mode's (the drain ablation sets interrupt_on_pull False, verl's bounded mode too). `peer`: the
    mode's own knobs (its Settings' fields: verl's staleness_threshold and trigger_sync_steps, AReaL's
    max_concurrent_rollouts, strict); None: the config's --peer section. `cost` given: the instances run it and the
    router sees it exactly (tests); else the preset with the derived KV capacity runs, and the router
    sees a fit (``router_cost_model``)."""
    mode = check_mode(mode)
    m = mode_of(mode)
    loaded = cost or profile_cost(load_cost_model(cfg.cost_model), cfg.hardware)
    hw = derive(cfg, loaded)
    true = cost or dataclasses.replace(loaded, kv_capacity=hw.kv_capacity)
    router = cost or router_cost_model(true, cfg, random.Random(cfg.seed * 31 + 7))
    if cfg.prompt_len + 2 > true.kv_capacity:
        raise ValueError(f"--prompt-len={cfg.prompt_len} does not fit the KV capacity {true.kv_capacity}")
    order = "completion" if m.peer else cfg.staleness.train_order  # --staleness.train-order: StaleFlow's modes only
    ccfg, stale = apply_mode(mode, cfg.coordinator, dataclasses.replace(cfg.staleness, eta=eta, train_order=order))
    ccfg = dataclasses.replace(ccfg, **(overrides or {}))  # the caller's overrides win over the mode's
    settings = mode_settings(mode, dict(peer) if peer is not None else cfg.peer)  # the search's knobs, else --peer
    colocated = m.colocated and cfg.colocated_sync
    gpus = cfg.total_gpus if colocated else cfg.rollout_gpus
    n_inst = max(1, gpus // cfg.gpus_per_instance)
    train_gpus = cfg.total_gpus if colocated else cfg.total_gpus - cfg.rollout_gpus
    sync = m.weight_sync if colocated or m.weight_sync != "colocated" else "broadcast"
    workload = SimWorkload(cfg, random.Random(cfg.seed))
    backend = SimBackend(
        cfg,
        hw,
        true,
        n_inst,
        train_gpus,
        sync,
        publish_every=m.publish_every(settings),
        mixed_kv=ccfg.interrupt_on_pull and ccfg.keep_kv_on_pull,
        plans=workload.plans,
        pull_interrupts=ccfg.interrupt_on_pull and not ccfg.keep_kv_on_pull,
    )
    loop = build_loop(
        mode,
        stale,
        ccfg,
        router,
        range(n_inst),
        backend,
        workload,
        cfg.steps,
        tick_s=cfg.tick_s,
        stall_s=stall_s(cfg, hw, train_gpus, stale),
        peer=settings,
    )
    return loop, backend, stale


def run(
    cfg: SimConfig,
    mode: str,
    eta: int,
    overrides: dict | None = None,
    label: str = "",
    cost: CostModel | None = None,
    peer: dict | None = None,
) -> SimResult:
    mode = check_mode(mode)
    loop, backend, stale = build(cfg, mode, eta, overrides, cost, label, peer)
    label = label or f"{mode} eta={stale.eta}"
    incomplete = ""
    try:  # the same driver as the runtime's; a stall ends this run with what it did
        loop.run(until=lambda: loop.done or backend.now() > cfg.max_sim_s)
        if not loop.done:
            incomplete = f"incomplete: max-sim-s {cfg.max_sim_s:.0f} reached"
    except Stalled as e:
        incomplete = f"incomplete: {e} (stalled at t={backend.now():.0f}s)"
    return _result(cfg, mode, stale.eta, label, loop, backend, incomplete)


def _result(
    cfg: SimConfig, mode: str, eta: int, label: str, loop: ControllerLoop, backend: SimBackend, incomplete: str
) -> SimResult:
    steps = loop.steps
    ends = backend.step_end[: len(steps)]
    done = len(ends)
    w = cfg.warmup_steps
    if done > w:
        t0 = ends[w - 1] if w > 0 else 0.0
        measured = ends[-1] - t0
        tokens = sum(r.response_tokens for r in steps[w:])
        samples = sum(len(r.rewards) for r in steps[w:])
    else:
        measured, tokens, samples = 0.0, 0, 0
    end = ends[-1] if ends else backend.now()
    c = loop.coord.counters
    aborts = {k[len("aborted_") :]: v for k, v in c.items() if k.startswith("aborted_")}
    fates = Counter(f.split(":")[0] for f in loop.ledger.ended.values())
    fates["live"] = len(loop.ledger.trajs)
    violations = list(loop.audit.violations)
    if incomplete:
        violations.append(incomplete)
    if done < cfg.steps:
        violations.append(f"incomplete: {done}/{cfg.steps} steps")
    stale = Counter(x for r in steps for x in r.staleness)
    step_times = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
    measured_steps = step_times[w:] or step_times
    transfer = (backend.hw.push_s if backend.sync == "ps" and not cfg.push_blocks_trainer else 0.0) + backend.pull_time
    plan_of = backend.plan_of

    def traj(g, tid, n):  # what the floor needs of a trained trajectory (sim/floor.py)
        pl = plan_of.get(tid)
        return (g.prompt_len, n) if pl is None else (g.prompt_len, n - pl.obs_tokens, pl.obs_tokens, pl.tool_total)

    floor = physical_floor(
        backend.cost,
        [[traj(g, t, n) for g in r.groups for t, n in zip(g.traj_ids, g.n_tokens)] for r in steps[w:done]],
        sum(backend.train_durs[w:done]) / max(1, len(backend.train_durs[w:done])),
        transfer,
        max(stale, default=0),
        [i.speed for i in backend.insts],
        cfg.max_running,
        backend.hw.prefill_tokens_per_s,
    )
    calls = sum(i.tool_calls for i in backend.insts)
    return SimResult(
        mode=mode,
        eta=eta,
        label=label,
        steps_done=done,
        sim_time_s=end,
        measured_s=measured,
        tokens=tokens,
        samples=samples,
        tokens_per_s=tokens / measured if measured > 0 else 0.0,
        samples_per_s=samples / measured if measured > 0 else 0.0,
        utilisation=[min(1.0, i.busy_s / end) if end > 0 else 0.0 for i in backend.insts],
        staleness_hist=dict(sorted(stale.items())),
        pulls=c["pulls"],
        interrupts=c["interrupted"],
        migrations=c["migrations"],
        aborts=aborts,
        trainer_idle_frac=1.0 - min(1.0, backend.trainer_busy_s / end) if end > 0 else 1.0,
        preemptions=sum(i.preemptions for i in backend.insts),
        over_eta=loop.audit.over_eta,
        train_s_mean=backend.trainer_busy_s / max(1, len(backend.step_end)),
        violations=violations,
        fates=dict(fates),
        step_times=step_times,
        fastest_speed=min((i.speed for i in backend.insts), default=1.0),
        longest=[max((n for g in r.groups for n in g.n_tokens), default=0) for r in steps],
        floor=floor,
        step_s=sum(measured_steps) / max(1, len(measured_steps)),
        tool_calls=calls,
        tool_s_mean=sum(i.tool_s for i in backend.insts) / calls if calls else 0.0,
        wall_p50=_quantile(backend.wall, 0.5),
        critical_slowdown=_mean(backend.critical[w:done]),
        spec_frac=sum(i.spec_tokens for i in backend.insts) / max(1, sum(i.tokens_out for i in backend.insts)),
        lanes=c["lanes_opened"],
        wall_p99=_quantile(backend.wall, 0.99),
        parked_taken={
            k: sum(i.parked_taken.get(k, 0) for i in backend.insts)
            for k in sorted({k for i in backend.insts for k in i.parked_taken})
        },
    )


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
