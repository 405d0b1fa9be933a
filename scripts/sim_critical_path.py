"""Where the simulated step waits, and whether the tail lanes reach the response that decides it (issue 49).

    python scripts/sim_critical_path.py                      # the paper-like centre, eta 3, seed 0, ~15 s
    python scripts/sim_critical_path.py --seed 1 --steps 12 --table
    python scripts/sim_critical_path.py --config default     # StaleFlow's default: speculative decoding, redundancy

Runs StaleFlow in the simulator at the grid's centre (30B-A3B authors 24:40) with and without
--coordinator.tail-lanes, in one of three configurations (--config): ``one-token`` (one token per step, the peers'
redundancy: the runs whose step the physical floor bounds; the default), ``one-token-redundancy`` (one token per
step, StaleFlow's own redundancy) or ``default`` (StaleFlow's default: speculative decoding and redundancy), and prints,
for each: throughput, step over the floor, the critical response's slowdown (the grid's numbers) and two
measures the grid does not have:
- lane reach: of the measured steps' critical responses (each step's last-finishing trained response), how many
  ever decoded on a lane, and the share of their wall time (first route to finish) spent there;
- the trainer's rhythm: for each buffer, when its training started and when its last response had finished
  (``--table``); the gaps between training starts show whether the run trains in bursts of eta + 1 buffers.
It observes the simulator from outside (it wraps the coordinator's command application and the simulated
backend's train call); nothing it measures changes a run. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from staleflow.coordinator import coordinator as coordinator_mod
from staleflow.coordinator.types import Lane
from staleflow.metrics.hardware import cpu_name
from staleflow.sim import backend as backend_mod
from staleflow.sim.config import SimConfig
from staleflow.sim.grid_settings import CENTRE, LANES, ONE_TOKEN, centre_cfg, fair
from staleflow.sim.simulator import run
from staleflow.trajectory import Route


class Observer:
    """What the wrapped calls saw during one run."""

    def __init__(self):
        self.laned: dict[int, float] = {}  # traj_id -> when it first decoded on a lane
        self.critical: list[tuple[float, float, int]] = []  # per trained buffer: (routed, finished, traj_id)
        self.trains: list[tuple[int, float, float]] = []  # (buffer, training start, its last response finished)


OBS = Observer()


def _observe() -> None:
    """Wrap Coordinator.apply (lane openings, routes onto a lane) and SimBackend.train (each batch)."""
    apply, train = coordinator_mod.Coordinator.apply, backend_mod.SimBackend.train

    def observed_apply(self, cmd, now, out):
        apply(self, cmd, now, out)
        if isinstance(cmd, Lane) and cmd.open:
            for t in self._inst(cmd.instance).trajs:
                OBS.laned.setdefault(t, now)
        elif isinstance(cmd, Route) and self._inst(cmd.instance).lane:
            OBS.laned.setdefault(cmd.traj_id, now)

    def observed_train(self, version, batch):
        spans = [self.first_route.get(t, (0.0, -1.0)) for g in batch for t in g.traj_ids]
        ids = [t for g in batch for t in g.traj_ids]
        i = max(range(len(ids)), key=lambda k: spans[k][1]) if ids else None
        if i is not None and spans[i][1] >= 0:
            OBS.critical.append((spans[i][0], spans[i][1], ids[i]))
            OBS.trains.append((version, self.t, spans[i][1]))
        return train(self, version, batch)

    coordinator_mod.Coordinator.apply = observed_apply
    backend_mod.SimBackend.train = observed_train


def measure(cfg: SimConfig, eta: int, lanes: bool) -> dict:
    global OBS
    OBS = Observer()
    t0 = time.perf_counter()
    r = run(cfg, "staleflow", eta, LANES if lanes else {}, "lanes" if lanes else "no lanes")
    crit = OBS.critical[cfg.warmup_steps :]
    shares = [(t1 - OBS.laned[t]) / (t1 - t0) for t0, t1, t in crit if t in OBS.laned and OBS.laned[t] < t1 and t1 > t0]
    starts = [s for _, s, _ in OBS.trains[cfg.warmup_steps :]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    return {
        "lanes": lanes,
        "tok_s": round(r.tokens_per_s, 1),
        "step_s": round(r.step_s, 1),
        "step_over_floor": round(r.step_s / r.floor.floor, 3) if r.floor and r.floor.floor else None,
        "binds": r.floor.binds if r.floor else None,
        "critical_slowdown": round(r.critical_slowdown, 3),
        "lanes_opened": r.lanes,
        "critical_in_lane": len(shares),
        "critical_measured": len(crit),
        "lane_share_of_wall": round(statistics.fmean(shares), 3) if shares else 0.0,
        "train_gap_median_s": round(statistics.median(gaps), 1) if gaps else None,
        "train_gap_max_s": round(max(gaps), 1) if gaps else None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "table": list(OBS.trains),
    }


CONFIGS = {
    "one-token": lambda cfg: {**fair(cfg), **ONE_TOKEN},
    "one-token-redundancy": lambda cfg: dict(ONE_TOKEN),
    "default": lambda cfg: {},
}
"""--config: the SimConfig changes from the grid's centre setting, as the grid's own columns make them."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="simulated steps (0: the grid's)")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="one-token", help="see the docstring")
    ap.add_argument("--table", action="store_true", help="print each buffer's training start and last finish")
    args = ap.parse_args(argv)
    _observe()
    name = CENTRE[0]
    cfg, eta = centre_cfg(args.steps, args.seed)
    cfg = dataclasses.replace(cfg, **CONFIGS[args.config](cfg))
    print(f"# machine: {cpu_name()} (the simulator is deterministic: the numbers do not depend on it)")
    print(f"# simulated: {name}, eta {eta}, seed {args.seed},")
    spec = "one token per step" if cfg.spec_accept == 1.0 else f"speculative acceptance {cfg.spec_accept}"
    red = cfg.staleness.batch_redundancy or cfg.staleness.group_redundancy
    print(
        f"#   {cfg.steps} steps ({cfg.warmup_steps} not measured), {spec}, {'redundancy' if red else 'no redundancy'}"
    )
    results = []
    for lanes in (False, True):
        m = measure(cfg, eta, lanes)
        results.append(m)
        print(
            f"{'lanes' if lanes else 'no lanes':9s} tok/s {m['tok_s']:8.0f}  step/floor {m['step_over_floor']}"
            f" ({m['binds']} binds)  critical slowdown {m['critical_slowdown']:.3f}  lanes opened {m['lanes_opened']}"
            f"  critical responses ever in a lane {m['critical_in_lane']}/{m['critical_measured']}"
            f" (share of their wall there {m['lane_share_of_wall']:.3f})  gaps between trainings: median"
            f" {m['train_gap_median_s']} s, max {m['train_gap_max_s']} s  [{m['wall_s']} s]"
        )
        if args.table:
            for b, start, last in m["table"]:
                print(f"    buffer {b:3d}  training starts {start:9.1f}  its last response finished {last:9.1f}")
    off, on = results
    summary = {k: [off[k], on[k]] for k in ("tok_s", "critical_slowdown", "critical_in_lane", "lane_share_of_wall")}
    out = {"setting": name, "eta": eta, "seed": args.seed, "config": args.config, "no_lanes_vs_lanes": summary}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
