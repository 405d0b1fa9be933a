"""Single-node runtime speed against an earlier commit: does a change (e.g. the multi-node plane)
slow down the one-node path?

    python scripts/bench_single_node.py --baseline 37b58b3 [--steps 12] [--repeats 3] [--preset tiny]

Checks the baseline commit out into a temporary git worktree and runs the same job from both
trees (the same venv, PYTHONPATH pointing at each tree's src/): ``python -m staleflow.launch.torchrun
--standalone``-style single-node torchrun, 1 trainer + 2 rollout ranks, same flags and seed.
Runs alternate (baseline, current, baseline, ...) because the machine's load drifts. Reports, per
tree, the mean over runs of the wall time of the job, and of the trained-samples throughput from
the end of step 2 to the last step (metrics.jsonl), then the ratios current / baseline. Prints the
hardware first and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from staleflow.metrics.hardware import cpu_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(tree: str, args, out_dir: str, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "src"), OMP_NUM_THREADS="1")
    port = _port()
    cmd = [
        sys.executable,
        "-m",
        "staleflow.launch.torchrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "3",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--local-addr",
        "127.0.0.1",
        "--rdzv-id",
        name,
        "-m",
        "staleflow",
        "train",
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--log.no-progress",
        "--log.no-plot",
        "--log.run-dir",
        out_dir,
        "--log.name",
        name,
        "--seed",
        "0",
    ]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name} failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out_dir, name, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "eval_n" not in r and "time" in r]
    first = next(r for r in rows if r["step"] >= 2)
    last = rows[-1]
    samples = sum(r["trained_trajectories"] for r in rows if r["step"] > first["step"])  # per step
    span = last["time"] - first["time"]
    return {"wall_s": wall, "samples_per_s": samples / span if span > 0 and samples else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="git revision to compare against")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="sf-bench-")
    base_tree = os.path.join(tmp, "baseline")
    subprocess.run(
        ["git", "worktree", "add", "--detach", "-f", base_tree, args.baseline],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    trees = {f"baseline {args.baseline}": base_tree, f"current {head}{'+changes' if dirty else ''}": ROOT}
    got: dict[str, list[dict]] = {k: [] for k in trees}
    try:
        for i in range(args.repeats):
            for label, tree in trees.items():
                name = f"{'b' if tree == base_tree else 'c'}{i}"
                r = run_once(tree, args, os.path.join(tmp, "runs"), name)
                got[label].append(r)
                print(
                    f"  {label:28s} run {i}: wall {r['wall_s']:6.1f} s, {r['samples_per_s']:6.2f} samples/s", flush=True
                )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base_tree], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    mean = {k: {m: sum(r[m] for r in v) / len(v) for m in ("wall_s", "samples_per_s")} for k, v in got.items()}
    (b, bm), (c, cm) = list(mean.items())
    print(
        f"\n{'tree':30s} {'wall s':>8s} {'samples/s':>10s}   (preset {args.preset}, {args.steps} steps, "
        f"mean of {args.repeats})"
    )
    for k, m in mean.items():
        print(f"{k:30s} {m['wall_s']:8.1f} {m['samples_per_s']:10.2f}")
    summary = {
        "wall_ratio": cm["wall_s"] / bm["wall_s"],
        "throughput_ratio": cm["samples_per_s"] / bm["samples_per_s"],
        "baseline": args.baseline,
        "current": c,
    }
    print(f"current / baseline: wall x{summary['wall_ratio']:.3f}, throughput x{summary['throughput_ratio']:.3f}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
