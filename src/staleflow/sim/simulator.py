"""Discrete-event run of one mode: the shared controller loop against the simulated backend.

``run(cfg, mode, eta, coordinator_overrides)`` builds what the real controller builds (the
StalenessManager, the Coordinator with the mode resolved once, the Ledger and the
ControllerLoop of staleflow.controller) and drives it over ``SimBackend`` (sim/backend.py):
simulated instances, trainer and weight transfers. The loop audits the protocol from outside
as in the runtime (the V_traj carried by Route commands, the bound of every trained group, the
fate of every trajectory); the result adds the simulated throughput and utilisation.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass, field

from staleflow.config import StalenessConfig
from staleflow.controller import ControllerLoop, Ledger, LoopSettings
from staleflow.coordinator.coordinator import Coordinator
from staleflow.coordinator.cost_model import CostModel, load_cost_model
from staleflow.coordinator.modes import COLOCATED, WEIGHT_SYNC, apply_mode
from staleflow.protocol.staleness import StalenessManager
from staleflow.sim.backend import SimBackend
from staleflow.sim.config import SimConfig


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


class SimWorkload:
    """Prompts of a fixed length; response lengths drawn per trajectory (the model does not decide)."""

    def __init__(self, cfg: SimConfig, rng: random.Random):
        self.prompt = cfg.prompt_len
        self.lengths = LengthSampler(cfg, rng)
        self.rng = rng

    def next_prompt(self) -> int:
        return self.prompt

    def prompt_len(self, prompt: int) -> int:
        return prompt

    def new_member(self) -> tuple[int, int]:
        return 0, self.lengths()


def build(cfg: SimConfig, mode: str, eta: int, overrides: dict | None = None, cost: CostModel | None = None,
          label: str = ""):
    """(loop, backend, resolved staleness config) of one simulated run, built like the runtime's."""
    cost = cost or load_cost_model(cfg.cost_model)
    if cfg.prompt_len + 2 > cost.kv_capacity:
        raise ValueError(f"--prompt-len={cfg.prompt_len} does not fit the KV capacity {cost.kv_capacity}")
    ccfg = dataclasses.replace(cfg.coordinator, **(overrides or {}))
    stale = StalenessConfig(eta=eta, batch_size=cfg.batch_size, batch_redundancy=cfg.batch_redundancy,
                            group_size=cfg.group_size, group_redundancy=cfg.group_redundancy,
                            straggler=cfg.straggler, straggler_threshold=cfg.straggler_threshold)
    ccfg, stale = apply_mode(mode, ccfg, stale)
    colocated = COLOCATED[mode]
    gpus = cfg.total_gpus if colocated else cfg.rollout_gpus
    n_inst = max(1, gpus // cfg.gpus_per_instance)
    train_gpus = cfg.total_gpus if colocated else cfg.total_gpus - cfg.rollout_gpus
    backend = SimBackend(cfg, cost, n_inst, train_gpus, WEIGHT_SYNC[mode])
    s = stale
    manager = StalenessManager(s.eta, s.batch_size, s.batch_size + s.batch_redundancy, s.group_size,
                               s.group_size + s.group_redundancy)
    coord = Coordinator(ccfg, cost, manager, range(n_inst), straggler=s.straggler,
                        straggler_threshold=s.straggler_threshold, clock=backend.now, label=label or mode)
    settings = dataclasses.replace(LoopSettings.from_config(s, ccfg, cfg.steps), tick_s=cfg.tick_s,
                                   stall_s=2000 * cfg.tick_s)
    loop = ControllerLoop(settings, coord, Ledger(), backend, SimWorkload(cfg, random.Random(cfg.seed)))
    return loop, backend, s


def run(cfg: SimConfig, mode: str, eta: int, overrides: dict | None = None, label: str = "",
        cost: CostModel | None = None) -> SimResult:
    loop, backend, stale = build(cfg, mode, eta, overrides, cost, label)
    label = label or f"{mode} eta={stale.eta}"
    incomplete = ""
    next_tick = 0.0
    while not loop.done:
        next_tick = loop.turn(next_tick)
        if backend.now() > cfg.max_sim_s:
            incomplete = f"incomplete: max-sim-s {cfg.max_sim_s:.0f} reached"
            break
        if backend.now() - loop.progress_at > loop.s.stall_s:
            incomplete = (f"incomplete: no trajectory finished and no step ran for {loop.s.stall_s:.0f} s "
                          f"(stalled at t={backend.now():.0f}s)")
            break
    return _result(cfg, mode, stale.eta, label, loop, backend, incomplete)


def _result(cfg: SimConfig, mode: str, eta: int, label: str, loop: ControllerLoop, backend: SimBackend,
            incomplete: str) -> SimResult:
    steps = loop.steps
    ends = backend.step_end[:len(steps)]
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
    aborts = {k[len("aborted_"):]: v for k, v in c.items() if k.startswith("aborted_")}
    fates = Counter(f.split(":")[0] for f in loop.ledger.ended.values())
    fates["live"] = len(loop.ledger.trajs)
    violations = list(loop.audit.violations)
    if incomplete:
        violations.append(incomplete)
    if done < cfg.steps:
        violations.append(f"incomplete: {done}/{cfg.steps} steps")
    stale = Counter(x for r in steps for x in r.staleness)
    return SimResult(
        mode=mode, eta=eta, label=label, steps_done=done, sim_time_s=end, measured_s=measured,
        tokens=tokens, samples=samples, tokens_per_s=tokens / measured if measured > 0 else 0.0,
        samples_per_s=samples / measured if measured > 0 else 0.0,
        utilisation=[min(1.0, i.busy_s / end) if end > 0 else 0.0 for i in backend.insts],
        staleness_hist=dict(sorted(stale.items())), pulls=c["pulls"], interrupts=c["interrupted"],
        migrations=c["migrations"], aborts=aborts,
        trainer_idle_frac=1.0 - min(1.0, backend.trainer_busy_s / end) if end > 0 else 1.0,
        preemptions=sum(i.preemptions for i in backend.insts), violations=violations, fates=dict(fates),
        step_times=[b - a for a, b in zip([0.0] + ends[:-1], ends)])
