"""Throughput of the four system modes on the same workload, measured in one invocation.

    python scripts/bench_modes.py [--steps 8] [--model tiny-llama] [--length-dist lognormal:96:0.9] [--max-new 512]

Each mode (sync, one-step-off, areal, staleflow) runs the real system (torchrun, 1 trainer + 2
rollout ranks + controller) on the same prompts, seeds and long-tailed response lengths
(`--rollout.length-dist`: each trajectory's length is drawn from a lognormal and eos is ignored,
which reproduces the skew of reasoning RL with a small model). Throughput counts only what the
trainer consumed: trained response tokens and trained trajectories per second, from the end of
the first step (start-up and the first buffer excluded) to the end of the last. Prints a table
with the hardware and, last, one JSON line with the ratios against sync.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

MODES = ["sync", "one-step-off", "areal", "staleflow"]


def run_mode(mode: str, args, root: str) -> dict:
    name = f"bench-{mode}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m", "staleflow",
           "train", "--preset", "tiny", "--model.path", args.model, "--mode", mode, "--steps", str(args.steps),
           "--rollout.length-dist", args.length_dist, "--rollout.max-new-tokens", str(args.max_new),
           "--rollout.max-model-len", str(args.max_new + 256), "--staleness.batch-size", str(args.batch),
           "--staleness.group-size", str(args.group), "--staleness.eta", str(0 if mode == "sync" else args.eta),
           "--log.run-dir", root, "--log.name", name, "--log.no-progress", "--log.no-plot", "--log.no-tensorboard",
           "--checkpoint.no-export-hf", "--seed", str(args.seed), *args.extra]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-15:])
        raise SystemExit(f"mode {mode} failed (exit {res.returncode}):\n{tail}")
    with open(os.path.join(root, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    first, rest = rows[0], rows[1:]
    span = rest[-1]["time"] - first["time"]
    tokens = sum(r["trained_tokens"] for r in rest)
    samples = sum(r["trained_trajectories"] for r in rest)
    return {
        "mode": mode, "steps": len(rows), "wall_s": wall, "measured_s": span,
        "tokens_per_s": tokens / span, "samples_per_s": samples / span,
        "staleness_mean": sum(r["staleness_mean"] * r["trained_groups"] for r in rest) / max(1, sum(r["trained_groups"] for r in rest)),
        "interrupts": rows[-1]["interrupts"], "pulls": rows[-1]["pulls"], "migrations": rows[-1]["migrations"],
        "train_s_mean": sum(r["train_s"] for r in rest) / len(rest),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--length-dist", default="lognormal:96:0.9")
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4, help="prompt groups per step (B)")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt (N)")
    ap.add_argument("--eta", type=int, default=2, help="staleness bound of the asynchronous modes (one-step-off: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("extra", nargs="*", help="more flags for every run (after --)")
    args = ap.parse_args()
    if args.steps < 3:
        raise SystemExit("--steps must be >= 3 (the first step is excluded from the measurement)")
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="staleflow-bench-") as root:
        results = [run_mode(m, args, root) for m in modes]
    base = next((r for r in results if r["mode"] == "sync"), None)
    print(f"# machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, {platform.python_version()}")
    print(f"# workload: {args.model}, B={args.batch} groups x N={args.group}, lengths {args.length_dist} "
          f"capped at {args.max_new}, eta={args.eta}, {args.steps} steps (first excluded)")
    print(f"{'mode':<13}{'tok/s':>9}{'samples/s':>11}{'vs sync':>9}{'staleness':>11}{'interrupts':>11}{'pulls':>7}"
          f"{'train s':>9}{'wall s':>8}")
    for r in results:
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        print(f"{r['mode']:<13}{r['tokens_per_s']:>9.1f}{r['samples_per_s']:>11.3f}{ratio:>9.2f}{r['staleness_mean']:>11.2f}"
              f"{r['interrupts']:>11}{r['pulls']:>7}{r['train_s_mean']:>9.2f}{r['wall_s']:>8.0f}")
    out = {f"{r['mode'].replace('-', '_')}_tok_s": round(r["tokens_per_s"], 2) for r in results}
    if base:
        for r in results:
            if r["mode"] != "sync":
                out[f"{r['mode'].replace('-', '_')}_vs_sync"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
                out[f"{r['mode'].replace('-', '_')}_samples_vs_sync"] = round(r["samples_per_s"] / base["samples_per_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
