"""What the trainer saw in two runs (or two sets of runs, paired by seed), side by side, with intervals.

    python scripts/compare_runs.py RUN_A RUN_B [--names A,B] [--json OUT.json] [--per-group OUT.jsonl] [--target 0.45]
    python scripts/compare_runs.py A_SEED0,A_SEED1,... B_SEED0,B_SEED1,...   # paired over seeds
    python scripts/compare_runs.py staleflow-eta1 areal-eta1 --bench runs/convergence   # every finished seed

Reads each run folder's trained.jsonl (one row per trained group: buffer, V_traj, rewards, members'
lengths, tokens per weight version, when its prompt was drawn) and metrics.jsonl (one row per step:
the trainer's importance-weight and KL statistics, interrupts, migrations; evaluation rows), rows
marked superseded (written after the checkpoint a run resumed from) left out. For every quantity it
prints A, B, B - A and a 95% interval of B - A:
- several runs per side: the runs are paired by their seed (config.json; in the given order when a
  seed is missing or repeated), the quantity is reduced per run, and the interval is Student's t over
  the per-seed differences (the runs of one seed share their prompt stream);
- one run per side: a percentile bootstrap (seeded) over the units the quantity is made of, each side
  resampled on its own: trained groups for the group rows, steps for the step rows; run-level counts
  (interrupts, final accuracy) have no interval from one run. Prompts trained in both runs (the same
  seed draws the same prompts) are also paired directly: "same prompt, step B - step A".

Quantities, by unit:
  group  staleness (buffer - V_traj) and the share of groups at each staleness; the share of tokens
         sampled at each token staleness (buffer - the version that sampled the token) and newer than
         the group's V_traj (keep-KV pulls and migrations make mixed-version responses); response
         length; reward, the group's reward variance and the share of all-equal groups (no learning
         signal: dynamic sampling drops them); order: the share of groups overtaken by a later-drawn
         one, |training rank - drawing rank|, steps and seconds from drawing the prompt to training it
  step   the trainer's importance ratio (mean, max), the share of ratios truncated and of tokens PPO
         clipped, KL(behaviour || current) k3 (mean and median over steps), entropy, gradient norm,
         token staleness, mixed-version token share, trainer seconds, groups dropped, train reward
  run    final held-out accuracy, interrupts, migrations, pulls, groups aborted, rank correlation of
         drawing order vs training order (Spearman); where the wall time went (metrics/walltime.py):
         wall seconds, trainer busy and waiting seconds, trainer ms per token, the step rhythm (sd / mean of
         the seconds between steps, without and with the gaps an evaluation overlaps), evaluation seconds,
         and from timeline.jsonl the rollout's busy share and pull seconds; bench.json's machine load
First the settings the two sides differ in (config.json: the first run of each side; seeds and names
left out), and a warning when one side's runs differ among themselves. Then time to target, explained: for every paired seed where both reached the target held-out accuracy
(--target; default A's mean final accuracy - 0.02, bench_convergence.py's rule with A as sync), B's
extra seconds split exactly into more tokens trained (the method), a slower trainer per token (the
machine: cores shared with rollout ranks) and more trainer waiting (rollout throughput).
Exit 2 on a missing or empty run folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from staleflow.metrics.compare import N_BOOT, RunError, compare, load_run, pair_runs
from staleflow.metrics.convergence import TARGET_MARGIN
from staleflow.metrics.settings import describe, mixed_settings, settings_diff
from staleflow.metrics.stats import spearman, t_interval
from staleflow.metrics.walltime import explain_pairs

__all__ = ["compare", "load_run", "spearman"]  # the analysis (metrics.compare, .stats), for tests and notebooks


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3e}" if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5) else f"{v:.4f}"


def table(rows: list[dict], names: tuple[str, str]) -> str:
    a, b = names
    lines = [f"{'quantity':62s} {a[:12]:>12s} {b[:12]:>12s} {'B - A':>11s}  {'95% interval':26s} method"]
    for r in rows:
        ci = f"[{_fmt(r['ci95'][0])}, {_fmt(r['ci95'][1])}]" if r.get("ci95") else "-"
        lines.append(
            f"{r['label'][:62]:62s} {_fmt(r['a']):>12s} {_fmt(r['b']):>12s} {_fmt(r['diff']):>11s}  {ci:26s} "
            f"{r['method']}"
        )
    return "\n".join(lines)


def gap_table(gaps: list[dict], target: float, names: tuple[str, str]) -> str:
    """Time to target, explained: one line per paired seed, then the mean with its t interval."""
    a, b = names
    head = (
        f"time to target {target:.3f} ({len(gaps)} paired seeds reached it on both sides): {b} - {a} = "
        "more tokens (method) + slower trainer per token (machine) + more trainer waiting (rollout)"
    )
    lines = [
        head,
        f"{'seed':>6s} {'versions':>9s} {'gap s':>8s} {'tokens s':>9s} {'rate s':>8s} {'wait s':>8s}  ms/token",
    ]
    for g in gaps:
        versions = "/".join(str(v) for v in g["versions"])
        lines.append(
            f"{str(g['seed']):>6s} {versions:>9s} {g['gap_s']:+8.1f} {g['tokens_s']:+9.1f} "
            f"{g['rate_s']:+8.1f} {g['wait_s']:+8.1f}  {g['ms_per_token'][0]:.1f} / {g['ms_per_token'][1]:.1f}"
        )
    if gaps:
        cells = []
        for k in ("gap_s", "tokens_s", "rate_s", "wait_s"):
            vals = [g[k] for g in gaps]
            ci = t_interval(vals)
            cells.append(f"{k} {sum(vals) / len(vals):+.1f}" + (f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else ""))
        lines.append("mean (95% t): " + "; ".join(cells))
    return "\n".join(lines)


def side(spec: str, bench: str) -> list[str]:
    """One side's run folders: a comma-separated list, or (with --bench) every finished seed of a mode."""
    if not bench:
        return [x for x in spec.split(",") if x]
    found = sorted(str(p.parent) for p in Path(bench).glob(f"{spec}-seed*/bench.json"))
    if not found:
        raise RunError(
            f"{bench} has no finished run named {spec}-seed*: name a mode as the bench does (staleflow-eta1)"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs_a", help="run folder, or comma-separated run folders (one per seed); with --bench: a mode")
    ap.add_argument("runs_b", help="the same for side B")
    ap.add_argument(
        "--bench",
        default="",
        help="a bench_convergence.py --out folder: RUNS_A / RUNS_B are then run names without the seed "
        "(staleflow-eta1, areal-eta1), expanded to every finished seed (NAME-seed*/bench.json)",
    )
    ap.add_argument("--names", default="", help="A,B labels (default: the first folders' names)")
    ap.add_argument("--json", default="", help="write the comparison here as JSON")
    ap.add_argument("--per-group", default="", help="write every trained group of every run here (JSON lines)")
    ap.add_argument("--boot", type=int, default=N_BOOT, help="bootstrap resamples (one run per side)")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help=f"held-out accuracy for the time-to-target split (default: A's mean final accuracy - {TARGET_MARGIN})",
    )
    args = ap.parse_args(argv)
    try:
        runs_a = [load_run(x) for x in side(args.runs_a, args.bench)]
        runs_b = [load_run(x) for x in side(args.runs_b, args.bench)]
        if not runs_a or not runs_b:
            raise RunError("give at least one run folder on each side")
        rows = compare(runs_a, runs_b, args.boot, args.seed)
    except (RunError, json.JSONDecodeError, KeyError) as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    names = tuple(args.names.split(",")) if args.names else (runs_a[0]["name"], runs_b[0]["name"])
    if len(names) != 2:
        print("compare_runs: --names takes two labels, A,B", file=sys.stderr)
        return 2
    pairs = pair_runs(runs_a, runs_b)
    print(f"A = {names[0]}: {', '.join(r['path'] for r, _ in pairs)}")
    print(f"B = {names[1]}: {', '.join(r['path'] for _, r in pairs)}")
    differ = settings_diff(runs_a, runs_b)
    effect = sum(not d["default"] for d in differ)
    print(f"settings {names[0]} -> {names[1]} (config.json, first run of each side): {effect} differ in effect")
    print("\n".join(describe(differ)))
    mixed = {n: mixed_settings(r) for n, r in zip(names, (runs_a, runs_b))}
    for n, keys in mixed.items():
        if keys:
            print(f"  WARNING: {n}'s runs differ among themselves in {', '.join(keys[:12])}: not one arm's seeds")
    print(table(rows, names))
    finals = [r["evals"][-1]["eval_accuracy"] for r, _ in pairs if r["evals"]]
    target = args.target if args.target is not None else (sum(finals) / len(finals) - TARGET_MARGIN if finals else None)
    gaps = explain_pairs(pairs, target) if target is not None else []
    if target is not None:
        print(gap_table(gaps, target, names))
    result = {"a": names[0], "b": names[1], "pairs": [[x["path"], y["path"]] for x, y in pairs], "rows": rows}
    result["time_to_target"] = {"target": target, "pairs": gaps}
    result["settings"] = {"differ": differ, "mixed": mixed}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.per_group:
        with open(args.per_group, "w") as fh:
            for r in runs_a + runs_b:
                for g in r["groups"]:
                    fh.write(json.dumps({"run": r["path"], **g}) + "\n")
    print(json.dumps({"a": names[0], "b": names[1], "quantities": len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
