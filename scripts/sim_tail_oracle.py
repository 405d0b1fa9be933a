"""How low can StaleFlow's step go if the long responses never shared an instance? An upper bound (issue 49).

    python scripts/sim_tail_oracle.py                       # the paper-like centre, eta 3, seed 0, ~3 min
    python scripts/sim_tail_oracle.py --seed 1 --extra 24 --lengths 20000 --carve 8

Issue 49 asks for StaleFlow's step <= 1.15x its physical floor (one token per step) on every throughput-bound row.
At the centre the tail term binds: the floor assumes each step's longest response decodes alone, while StaleFlow's
critical response (each step's last-finishing trained response) takes ~1.5x that beside its co-runners. This
script runs an ORACLE that knows every response's drawn length from its first token and routes each response of
>= L tokens onto instances set aside for it, the least loaded first (every other response is scheduled by StaleFlow
as usual), in two forms:
- ``free``: ``--extra`` K instances ADDED to the fleet for the oracle alone (more GPUs, used by nothing else): how
  far isolation can take the step, and how many instances it keeps busy at its peak;
- ``K of own``: K of the fleet's own instances set aside (``--carve``): the same perfect knowledge, paying for its
  lanes with the fleet's capacity, as any real design must.
Neither is realisable (no system knows a length in advance): both are upper bounds on length-aware isolation.

Runs at the grid's centre setting (30B-A3B authors 24:40), one token per step, the peers' redundancy (none), eta 3,
beside ``base`` (StaleFlow as the grid runs it, 24 rollout instances) and ``extra K, idle``, the control (the extra
instances take no work, but pull weights beside the fleet and share the Parameter Server's egress: -0.3 % with 96
at the centre). For each: tokens/s, the step over the base run's physical floor (extra GPUs lower the work term,
not the tail term that binds) and over its own, the critical slowdown, the routes the oracle redirected, the mean
responses on an oracle instance after each and the most oracle instances holding work at once. The oracle wraps
the routing pass's route_one from outside (every Route goes through it); the runs themselves are the simulator's.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from staleflow.coordinator import routing as routing_mod
from staleflow.metrics.hardware import cpu_name
from staleflow.sim import simulator as simulator_mod
from staleflow.sim.config import SimConfig
from staleflow.sim.grid_settings import CENTRE, ONE_TOKEN, centre_cfg, fair


class Oracle:
    """One run's oracle: which instances are its own, L, what it saw (the controller's ledger holds the lengths)."""

    def __init__(self, first_extra: int = -1, min_len: int = 0):
        self.first_extra, self.min_len = first_extra, min_len
        self.ledger = self.backend = None
        self.routed = 0  # routes the oracle made (a loop-back routed again counts again)
        self.trajs: set[int] = set()  # distinct trajectories it routed
        self.shortest = 0  # shortest drawn length it routed (>= min_len by construction; the test reads it)
        self.busy: list[int] = []  # per route: responses on that instance after it
        self.peak = 0  # most oracle instances holding work at once

    def projected(self, inst) -> int:
        """KV the instance's trajectories will hold at their drawn lengths (the oracle knows them)."""
        trajs = self.ledger.trajs
        return sum(trajs[t].prompt_len + trajs[t].target_len for t in inst.trajs if t in trajs)

    def instances(self) -> list:
        return [] if self.backend is None or self.first_extra < 0 else self.backend.insts[self.first_extra :]


ORACLE = Oracle()


def _install() -> None:
    """Wrap simulator.build (the oracle's instances become lanes: the routing pass, migration and the waterfall feed
    them nothing; tail lanes stay off in these runs, so nothing reopens them) and the routing pass's place (every
    queued trajectory, fresh or looped back, is placed there): a response of >= L drawn tokens goes to the least
    loaded oracle instance that may take it by the router's own rules (its V_traj admitted, not draining, no engine
    queue) and whose KV still fits at the drawn lengths of all it holds; else to the fleet as usual."""
    build, place = simulator_mod.build, routing_mod.RoutingPass.place

    def oracle_build(*args, **kwargs):
        loop, backend, stale = build(*args, **kwargs)
        ORACLE.ledger, ORACLE.backend = loop.ledger, backend
        assert not loop.coord.cfg.tail_lanes, "the oracle's instances are lanes: tail lanes would reopen them"
        assert not loop.coord.cfg.barrier, "the oracle places fresh groups without the batch barrier's budget"
        if ORACLE.first_extra >= 0:
            for i in loop.coord.instances:
                if i >= ORACLE.first_extra:
                    loop.coord._inst(i)._set_lane(True)
        return loop, backend, stale

    def oracle_place(self, rec, srec, open_, failed, sig):
        o, c = ORACLE, self.c
        traj = o.ledger.trajs.get(rec.traj_id) if o.min_len > 0 and o.first_extra >= 0 else None
        if traj is not None and traj.target_len >= o.min_len:
            V = sig[0]
            if V is None or srec.reserved or c.manager.can_admit(V, rec.group_id):
                need = traj.prompt_len + traj.target_len
                room = [
                    s
                    for i, s in c.instances.items()
                    if i >= o.first_extra
                    and not s.draining
                    and s.waiting == 0
                    and len(s.trajs) < c.cfg.max_concurrent
                    and (c.manager.can_admit(s.target_version) if V is None else s.target_version >= V)
                    and o.projected(s) + need <= s.kv_capacity
                ]
                if room:  # a fresh group takes the newest version first (its deadline as late as possible)
                    inst = min(room, key=lambda s: (-s.target_version if V is None else 0, s.engaged, s.instance))
                    o.routed += 1
                    o.trajs.add(rec.traj_id)
                    o.shortest = min(o.shortest or traj.target_len, traj.target_len)
                    o.busy.append(inst.engaged + 1)
                    used = sum(1 for i, s in c.instances.items() if i >= o.first_extra and s.load)
                    o.peak = max(o.peak, used + (not inst.load))
                    return inst, (inst.target_version if V is None else V)
        return place(self, rec, srec, open_, failed, sig)

    simulator_mod.build = oracle_build
    routing_mod.RoutingPass.place = oracle_place


def measure(cfg: SimConfig, eta: int, name: str, extra: int, carve: int, min_len: int, base_floor) -> dict:
    """One run: `extra` instances added for the oracle, or `carve` of the fleet's own set aside for it."""
    global ORACLE
    n_base = cfg.rollout_gpus // cfg.gpus_per_instance
    if extra:
        g = extra * cfg.gpus_per_instance
        cfg = dataclasses.replace(cfg, rollout_gpus=cfg.rollout_gpus + g, total_gpus=cfg.total_gpus + g)
    ORACLE = Oracle(n_base if extra else n_base - carve if carve else -1, min_len)
    t0 = time.perf_counter()
    r = simulator_mod.run(cfg, "staleflow", eta, {}, name)
    floor = base_floor if base_floor is not None else (r.floor.floor if r.floor else None)
    return {
        "run": name,
        "tok_s": round(r.tokens_per_s, 1),
        "step_s": round(r.step_s, 1),
        "floor_s": round(floor, 1) if floor else None,
        "step_over_floor": round(r.step_s / floor, 3) if floor else None,
        "step_over_own_floor": round(r.step_s / r.floor.floor, 3) if r.floor and r.floor.floor else None,
        "binds": r.floor.binds if r.floor else None,
        "critical_slowdown": round(r.critical_slowdown, 3),
        "oracle_routes": ORACLE.routed,
        "oracle_trajectories": len(ORACLE.trajs),
        "oracle_shortest": ORACLE.shortest,
        "oracle_tokens": sum(i.tokens_out for i in ORACLE.instances()),
        "oracle_preemptions": sum(i.preemptions for i in ORACLE.instances()),
        "preemptions": r.preemptions,
        "oracle_busy_mean": round(statistics.fmean(ORACLE.busy), 2) if ORACLE.busy else None,
        "oracle_instances_peak": ORACLE.peak,
        "worst_staleness": max(r.staleness_hist, default=0),
        "violations": len(r.violations),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="simulated steps (0: the grid's)")
    ap.add_argument(
        "--speculative", action="store_true", help="StaleFlow's default speculative decoding, not one token per step"
    )
    ap.add_argument("--extra", type=int, default=96, help="instances added for the free oracle (default: 96)")
    ap.add_argument("--lengths", default="20000,30000", help="comma-separated L: drawn tokens from which it routes")
    ap.add_argument(
        "--carve",
        default="4,8,12,16",
        help="comma-separated K: the oracle on K of the fleet's own instances (the price)",
    )
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    carve = [int(x) for x in args.carve.split(",") if x.strip()]
    if args.extra < 1 or not lengths or min(lengths) < 1:
        ap.error("--extra must be >= 1 and --lengths positive integers")
    _install()
    name = CENTRE[0]
    cfg, eta = centre_cfg(args.steps, args.seed)
    cfg = dataclasses.replace(cfg, **{**fair(cfg), **({} if args.speculative else ONE_TOKEN)})
    if any(not 0 < k < cfg.rollout_gpus // cfg.gpus_per_instance for k in carve):
        ap.error(f"--carve: each K must leave the fleet of {cfg.rollout_gpus // cfg.gpus_per_instance} some instances")
    print(f"# machine: {cpu_name()} (the simulator is deterministic: the numbers do not depend on it)")
    print(
        f"# simulated: {name}, eta {eta}, seed {args.seed}, {cfg.steps} steps ({cfg.warmup_steps} not measured), "
        f"{'speculative decoding' if args.speculative else 'one token per step'}, no redundancy;"
        f" {cfg.rollout_gpus // cfg.gpus_per_instance} rollout instances"
    )
    rows = [measure(cfg, eta, "base", 0, 0, 0, None)]
    floor = rows[0]["floor_s"]
    rows.append(measure(cfg, eta, f"extra {args.extra}, idle", args.extra, 0, 0, floor))
    rows += [measure(cfg, eta, f"oracle L={n}, free", args.extra, 0, n, floor) for n in lengths]
    rows += [measure(cfg, eta, f"oracle L={n}, {k} of own", 0, k, n, floor) for k in carve for n in lengths]
    for m in rows:
        print(
            f"{m['run']:24s} tok/s {m['tok_s']:8.0f}  step {m['step_s']:7.1f} s  step/floor {m['step_over_floor']}"
            f" (own floor {m['step_over_own_floor']}, {m['binds']} binds)  critical slowdown"
            f" {m['critical_slowdown']:.3f}  oracle: {m['oracle_trajectories']} responses, {m['oracle_routes']} routes"
            f" (busy {m['oracle_busy_mean']}, peak {m['oracle_instances_peak']} instances, preempted"
            f" {m['oracle_preemptions']} of the fleet's {m['preemptions']})  violations {m['violations']}"
            f"  [{m['wall_s']} s]"
        )
    print(json.dumps({"setting": name, "eta": eta, "seed": args.seed, "extra": args.extra, "runs": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
