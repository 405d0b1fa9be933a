"""Benchmark: cost of one coordinator tick at 128 instances with ~10k queued trajectories.

    python scripts/bench_coordinator.py [--instances 128] [--queued 10000] [--ticks 300]
    python scripts/bench_coordinator.py --against /path/to/other/checkout --rounds 3 --ticks 200

Steady state: every instance runs up to --max-concurrent trajectories (versions 0..3 spread over
instances), the Trajectory Server holds --queued trajectories (40% interrupted loop-backs tagged
at versions 0..3, 60% new prompts), and before each tick --finish random trajectories finish
(on_finished + on_rewarded) and are replaced by new prompts, and every instance sends a snapshot.
Measured in the same run:
  staleflow   waterfall + MLQ + status pull + migration (the default strategies)
  staleflow-simple-strategies   least-loaded routing over a FIFO queue, greedy pull, no migration
  unbounded   staleflow without the per-level scan bound and failure cache (baseline: scans the queue)
Prints p50/p99 tick time (tick() only, and tick + the 128 snapshots); last line JSON.
--against DIR: before/after in the same run: this checkout's bench and DIR's own scripts/bench_coordinator.py
(each against its own src/, in a fresh process, which runs first alternating) for --rounds rounds; prints both
p50s per round, their medians and the ratio (this / DIR's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from staleflow.config import CoordinatorConfig
from staleflow.controller.ledger import Traj
from staleflow.coordinator import Coordinator, InstanceSnapshot, load_cost_model
from staleflow.coordinator.record import RESERVE
from staleflow.metrics.hardware import cpu_name
from staleflow.modes import apply_mode
from staleflow.protocol import StalenessSpec
from staleflow.protocol.staleness import StalenessManager


def build(mode: str, cfg: CoordinatorConfig, args, rng: random.Random):
    cost = load_cost_model("qwen2.5-32b-tp2")
    m = StalenessManager(StalenessSpec(eta=3, batch_size=1_000_000, group_size=1))
    m.version = 3  # versions 0..3 exist (the trainer consumed three buffers)
    now = [0.0]
    cfg, _ = apply_mode(mode, cfg)
    trajs: dict[int, Traj] = {}  # the ledger's table (one-member groups: group id = trajectory id)
    c = Coordinator(cfg, cost, m, range(args.instances), trajs=trajs, version=3, clock=lambda: now[0], label=mode)
    for i in c.instances:  # spread instance versions 0..3 (as if each had pulled that version)
        c.on_pull_done(i, i % 4)
    c.on_new_version(3)
    ids = iter(range(10**9))
    for _ in range(int(args.queued * 0.4)):  # interrupted loop-backs with their tags
        t, V = next(ids), rng.randint(0, 3)
        m.reserve(t, t, V)
        c.group_tag[t] = V
        trajs[t] = Traj(t, t, 0, traj_version=V, n_tokens=rng.randint(1, 8000), prompt_len=512)
    loop_backs = list(trajs)
    fill = args.instances * args.max_concurrent  # routed while filling the instances; ~queued remain
    fresh = [next(ids) for _ in range(args.queued + fill - len(trajs))]
    c.submit(loop_backs + new_trajs(trajs, fresh))
    for t in loop_backs:  # they hold the reservation made above (their first route, before the interrupt)
        c.sched.transition(t, RESERVE)
    return c, m, ids, now, trajs


def new_trajs(trajs: dict[int, Traj], ids: list[int]) -> list[int]:
    """Add fresh one-member groups to the table (as the ledger does for a new prompt); their ids."""
    for t in ids:
        trajs[t] = Traj(t, t, 0, prompt_len=512)
    return ids


def run(mode: str, cfg: CoordinatorConfig, args) -> dict:
    rng = random.Random(0)
    c, m, ids, now, trajs = build(mode, cfg, args, rng)
    for _ in range(200):  # fill the instances
        now[0] += 0.01
        c.tick(now[0])
    tick_ms, full_ms = [], []
    for _ in range(args.ticks):
        now[0] += 0.01
        running = [(i, t) for i, s in c.instances.items() for t in s.trajs]
        for i, t in rng.sample(running, min(args.finish, len(running))):
            if c.on_finished(i, t):  # one-member groups: group id = trajectory id
                c.on_rewarded(t)
                del trajs[t]  # consumed: it leaves the ledger's table
        c.submit(new_trajs(trajs, [next(ids) for _ in range(args.finish)]))
        t0 = time.perf_counter()
        for i, s in c.instances.items():
            c.on_snapshot(
                InstanceSnapshot(i, s.version, s.load, 0, s.kv_tokens + 5000, s.kv_capacity, 900.0, s.syncing, now[0])
            )
        t1 = time.perf_counter()
        c.tick(now[0])
        t2 = time.perf_counter()
        tick_ms.append((t2 - t1) * 1e3)
        full_ms.append((t2 - t0) * 1e3)
    q = sorted(tick_ms)
    return {
        "mode": mode,
        "p50_ms": statistics.median(tick_ms),
        "p99_ms": q[int(0.99 * (len(q) - 1))],
        "mean_ms": statistics.fmean(tick_ms),
        "with_snapshots_p50_ms": statistics.median(full_ms),
        "queued": len(c.queue),
        "routes": c.counters["routes"],
        "load": sum(s.load for s in c.instances.values()),
    }


def against(args) -> None:
    """This checkout's tick against another checkout's, alternating fresh processes (same machine, same load)."""
    here = Path(__file__).resolve().parents[1]
    other = Path(args.against).resolve()
    if not (other / "scripts" / "bench_coordinator.py").is_file() or not (other / "src" / "staleflow").is_dir():
        sys.exit(
            f"--against={args.against!r}: not a StaleFlow checkout (no scripts/bench_coordinator.py, src/staleflow)"
        )
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("instances", "queued", "ticks", "finish")]
    flags.append(f"--max-concurrent={args.max_concurrent}")

    def one(root: Path) -> dict:
        env = dict(os.environ, PYTHONPATH=str(root / "src"))
        cmd = [sys.executable, str(root / "scripts" / "bench_coordinator.py"), *flags]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
        if res.returncode:
            sys.exit(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])

    print(
        f"host: {cpu_name()}, {os.cpu_count()} cpus, python {platform.python_version()}; load {os.getloadavg()[0]:.1f}"
    )
    print(f"this: {here}\nbaseline: {other}\n{'round':>5s} {'this p50 ms':>12s} {'baseline p50 ms':>16s}")
    mine, base = [], []
    for r in range(args.rounds):  # the order alternates: neither tree always runs first
        a, b = (one(here), one(other)) if r % 2 == 0 else reversed((one(other), one(here)))
        mine.append(a["tick_p50_ms"])
        base.append(b["tick_p50_ms"])
        print(f"{r:5d} {mine[-1]:12.4f} {base[-1]:16.4f}", flush=True)
    m, b = statistics.median(mine), statistics.median(base)
    print(json.dumps({"tick_p50_ms": m, "baseline_tick_p50_ms": b, "ratio": round(m / b, 3), "rounds": args.rounds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=128)
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--ticks", type=int, default=300)
    ap.add_argument("--finish", type=int, default=20, help="trajectories finishing between two ticks")
    ap.add_argument("--max-concurrent", type=int, default=64)
    ap.add_argument("--against", default="", help="another checkout's root: run its bench too, alternating")
    ap.add_argument("--rounds", type=int, default=3, help="--against: alternating rounds")
    args = ap.parse_args()
    if args.against:
        return against(args)
    base = CoordinatorConfig(
        cost_model="qwen2.5-32b-tp2",
        max_concurrent=args.max_concurrent,
        migration=True,
        pull="status",
        pull_indicator="kv",
        pull_threshold=0.6,
    )
    print(
        f"host: {cpu_name()}, {os.cpu_count()} cpus, python {platform.python_version()}; {args.instances} instances, "
        f"{args.queued} queued, {args.finish} finishes/tick, max_concurrent {args.max_concurrent}, {args.ticks} ticks"
    )
    rows = [
        run("staleflow", base, args),
        run("staleflow-simple-strategies", base, args),
        run("staleflow", CoordinatorConfig(**{**base.__dict__, "scan_limit": 10**9}), args) | {"mode": "unbounded"},
    ]
    print(
        f"{'variant':28s} {'p50 ms':>8s} {'p99 ms':>8s} {'mean ms':>8s} {'+snap p50':>10s} {'queued':>7s} {'routes':>7s}"
    )
    for r in rows:
        print(
            f"{r['mode']:28s} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['mean_ms']:8.3f} "
            f"{r['with_snapshots_p50_ms']:10.3f} {r['queued']:7d} {r['routes']:7d}"
        )
    sf, un = rows[0], rows[2]
    print(
        json.dumps(
            {
                "tick_p50_ms": round(sf["p50_ms"], 4),
                "tick_p99_ms": round(sf["p99_ms"], 4),
                "tick_with_snapshots_p50_ms": round(sf["with_snapshots_p50_ms"], 4),
                "simple_strategies_tick_p50_ms": round(rows[1]["p50_ms"], 4),
                "unbounded_tick_p50_ms": round(un["p50_ms"], 4),
                "speedup_vs_unbounded": round(un["p50_ms"] / sf["p50_ms"], 2),
                "target_met": sf["p50_ms"] < 1.0,
                "instances": args.instances,
                "queued": args.queued,
            }
        )
    )


if __name__ == "__main__":
    main()
