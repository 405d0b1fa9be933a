"""Convergence at bounded staleness: held-out accuracy of sync and StaleFlow at several eta, same task.

    python scripts/bench_convergence.py [--etas 1,2,4] [--steps 20] [--out runs/convergence] [-- extra train flags]

Runs the main job (./launch.sh, default preset: SmolLM2-135M on arithmetic, held-out evaluation
of 64 prompts) once in `--mode sync` (eta 0, the baseline) and once per eta in `--mode staleflow`,
each for the same number of steps and the same seed. Reads every run's held-out evaluations
(metrics.jsonl rows with eval_accuracy) and its wall time, prints a table (accuracy at step 0 and
at the end, gain, wall time, the ratio of wall time to sync's) with the hardware, writes one PNG
with held-out accuracy against step and against wall time, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from staleflow.metrics.hardware import cpu_name

ROOT = Path(__file__).resolve().parents[1]


def run(name: str, mode: str, eta: int, args, extra: list[str]) -> dict:
    cmd = ["bash", str(ROOT / "launch.sh"), "--mode", mode, "--staleness.eta", str(eta), "--steps", str(args.steps),
           "--seed", str(args.seed), "--log.run-dir", args.out, "--log.name", name, "--log.no-progress",
           "--eval.every", str(args.eval_every), *extra]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, STALEFLOW_MAX_RESTARTS="0"))
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name} failed (exit {res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    rows = [json.loads(x) for x in (Path(args.out) / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if "eval_n" in r and not r.get("superseded")]
    steps = [r for r in rows if "eval_n" not in r and not r.get("superseded")]
    return {"name": name, "mode": mode, "eta": eta, "wall_s": wall,
            "eval": [(r["step"], r["eval_accuracy"], r["time"]) for r in evals],
            "reward_last5": sum(r["reward_mean"] for r in steps[-5:]) / max(1, len(steps[-5:])),
            "staleness_mean": sum(r["staleness_mean"] for r in steps) / max(1, len(steps))}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        label = "sync" if r["mode"] == "sync" else f"staleflow eta={r['eta']}"
        a1.plot([e[0] for e in r["eval"]], [e[1] for e in r["eval"]], "o-", label=label)
        a2.plot([e[2] / 60 for e in r["eval"]], [e[1] for e in r["eval"]], "o-", label=label)
    a1.set_xlabel("step (weight version)")
    a2.set_xlabel("wall time (min)")
    for a in (a1, a2):
        a.set_ylabel("held-out accuracy (greedy)")
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"Convergence at bounded staleness ({cpu_name()}, {os.cpu_count()} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--etas", default="1,2,4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/convergence")
    args = ap.parse_args(argv)
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores; {args.steps} steps each, seed {args.seed}; "
          f"extra flags: {extra or 'none'}", flush=True)
    plan = [("sync", "sync", 0)] + [(f"staleflow-eta{e}", "staleflow", int(e)) for e in args.etas.split(",")]
    results = []
    for name, mode, eta in plan:
        results.append(run(name, mode, eta, args, extra))
        r = results[-1]
        print(f"  {name:18s} held-out {r['eval'][0][1]:.3f} -> {r['eval'][-1][1]:.3f}  wall {r['wall_s']:.0f} s",
              flush=True)
    base = results[0]
    print(f"\n{'run':18s} {'acc@0':>6s} {'acc@end':>8s} {'gain':>6s} {'wall s':>7s} {'x sync time':>11s} "
          f"{'reward last5':>12s} {'staleness':>9s}")
    for r in results:
        a0, a1 = r["eval"][0][1], r["eval"][-1][1]
        print(f"{r['name']:18s} {a0:6.3f} {a1:8.3f} {a1 - a0:+6.3f} {r['wall_s']:7.0f} "
              f"{r['wall_s'] / base['wall_s']:11.2f} {r['reward_last5']:12.3f} {r['staleness_mean']:9.2f}")
    png = os.path.join(args.out, "convergence.png")
    plot(results, png)
    print(f"wrote {png}")
    print(json.dumps({r["name"]: {"acc_start": r["eval"][0][1], "acc_end": r["eval"][-1][1], "wall_s": round(r["wall_s"]),
                                  "wall_vs_sync": round(r["wall_s"] / base["wall_s"], 3)} for r in results}))


if __name__ == "__main__":
    main()
