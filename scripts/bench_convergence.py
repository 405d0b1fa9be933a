"""Convergence at bounded staleness, with statistics: held-out accuracy of each mode over seeds.

    python scripts/bench_convergence.py [--seeds 0,1,2] [--steps 30] [--eval-every 5] [--eval-n 128]
        [--modes verl-sync,staleflow:1,staleflow:2,verl-fully-async:1,areal:1] [--out runs/convergence]
        [--margin 0.05] [--keep-models] [--archive DIR] [--no-run] [--smoke] [-- extra train flags]

Runs the main job (./launch.sh, default preset: SmolLM2-135M on arithmetic-easy) once per mode and
seed: verl-sync (eta 0, the baseline), staleflow at eta 1 and 2, and verl-fully-async and areal at
NOMINAL eta 1 (their own staleness rules: the observed staleness is reported, it may exceed 1).
`verl-fully-async-matched:1` names the guarantee-matched peer (verl fully-async with
--peer.verl-fully-async.staleness-threshold 0 --peer.verl-fully-async.trigger-sync-steps eta+1, bounded at eta
by a count).
--seeds takes a list and ranges (0-7 = 0,1,...,7). Seed s sets --seed s and --data.seed s, so the
runs of one seed share their held-out prompts (--eval-n of them, never trained on) and their prompt
stream: the comparison with sync is paired.
Runs go seed by seed (every mode of seed 0, then seed 1, ...) so that a shared machine's load drift
spreads over the modes. A finished run leaves RUN/bench.json with only what its folder cannot give
back (wall time; the machine's 1-minute load average sampled every 10 s while it ran: start, end,
mean, max); everything else is derived again from RUN/metrics.jsonl on every read, so a second
call (or a later session with the same --out) resumes where the first stopped and re-derives the
finished runs with the current code; an unfinished run is started again from scratch. A finished
run's checkpoints/ and hf/ (~2 GB) are deleted once it is saved, unless --keep-models. --archive DIR
also copies each finished run's record (bench.json, metrics.jsonl, trained.jsonl, config.json, timeline.jsonl: ~0.1 MB)
to DIR/NAME and reads runs from there, so a study committed to the repository (docs/results/) goes on
from another machine or session; --no-run starts nothing and reports the finished runs.

Prints per mode: final held-out accuracy (mean and standard deviation over seeds), the paired
difference against sync (mean over seeds, 95% Student t interval over the per-seed differences),
wall time (and its ratio to sync's), mean and maximum staleness of the trained groups, and
time-to-target: the time since the run started at which the first evaluated policy reached the
target = sync's mean final accuracy - 0.02 (mean over the seeds that reached it), with its paired
difference against sync, the version (step) that reached it, and, since runs that never reach it have
no time, a censored comparison: in how many seeds the mode got there before its sync pair, sync did, or
neither, with an exact sign test; the trainer's off-policy diagnostics; the mechanics (median over steps of
KL(behaviour || current), trainer seconds, interrupts and migrations per run, the share of tokens
sampled by a later version than their response's first, token staleness, machine load); and, when
staleflow and sync, areal or the matched peer at its eta are present, an equivalence statement (two
one-sided t tests at +-margin on the per-seed differences) with the seeds 80% power would need at the observed
spread, split into evaluation noise and run-to-run spread when the runs recorded per-prompt answers.
Writes one PNG (held-out accuracy against wall time and against step, mean over seeds with a +-1 std
band) and ends with one JSON line. --smoke: tiny preset, 2 steps, 1 seed, 4 held-out prompts, sync
and staleflow eta 1 only (checks the plumbing; its accuracies mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import fmean, pstdev

from staleflow.metrics import records
from staleflow.metrics.convergence import (
    DIAG,
    TARGET_MARGIN,
    aggregate,
    equivalence,
    eval_noise_var,
    label,
    mechanics,
    summarize_run,
    time_to_target,
)
from staleflow.metrics.hardware import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODES = "verl-sync,staleflow:1,staleflow:2,verl-fully-async:1,areal:1"
SAVED = ("name", "mode", "eta", "seed", "wall_s", "load_start", "load_end", "load_mean", "load_max", "load_samples")
"""What bench.json keeps: what the run folder cannot give back. The rest is derived on every read."""
RECORD = ("bench.json", "metrics.jsonl", "trained.jsonl", "config.json", "timeline.jsonl")
"""A finished run's record (--archive): what this bench and scripts/compare_runs.py read back."""
LOAD_EVERY_S = 10.0
VARIANTS = {"verl-fully-async-matched": "verl-fully-async"}
"""Bench names for a mode run with its own knobs: verl-fully-async-matched is the guarantee-matched peer,
verl fully-async with staleness_threshold 0 and trigger_parameter_sync_step eta + 1 (it bounds every
trajectory's staleness at eta by a count: docs/baselines.md)."""


def launch_mode(mode: str, eta: int) -> list[str]:
    """The launch flags that select bench mode `mode` at `eta` (a VARIANTS name adds its peer's knobs)."""
    if mode == "verl-fully-async-matched":
        knobs = ["--peer.verl-fully-async.staleness-threshold", "0", "--peer.verl-fully-async.trigger-sync-steps"]
        knobs.append(str(eta + 1))
        return ["--mode", VARIANTS[mode], *knobs]
    return ["--mode", mode]


__all__ = [
    "DIAG",
    "aggregate",
    "eval_noise_var",
    "mechanics",
    "summarize_run",
    "time_to_target",
]  # staleflow.metrics.convergence


def parse_modes(spec: str) -> list[tuple[str, int]]:
    """'verl-sync,staleflow:1' -> [('verl-sync', 0), ('staleflow', 1)]; verl-sync is always eta 0."""
    out = []
    for item in spec.split(","):
        mode, _, eta = item.strip().partition(":")
        out.append((mode, 0 if mode == "verl-sync" else int(eta or 1)))
    if ("verl-sync", 0) not in out:
        raise SystemExit("--modes must include verl-sync: it is the baseline every other mode is paired with")
    return out


def parse_seeds(spec: str) -> list[int]:
    """'0,1,2' or '0-7' (inclusive) or '0-3,8' -> the seeds, in order, without repeats."""
    out: list[int] = []
    for item in spec.split(","):
        lo, dash, hi = item.strip().partition("-")
        try:
            got = range(int(lo), int(hi) + 1) if dash else [int(lo)]
        except ValueError:
            raise SystemExit(f"--seeds {spec!r}: give seeds as 0,1,2 or a range 0-7") from None
        out += [s for s in got if s not in out]
    if not out:
        raise SystemExit(f"--seeds {spec!r} names no seed: give seeds as 0,1,2 or a range 0-7")
    return out


def run_one(name: str, mode: str, eta: int, seed: int, args, extra: list[str]) -> dict | None:
    """One run of the main job, or its saved result (in --out, else in --archive); None if it failed
    twice, or was not run (--no-run)."""
    out = Path(args.out) / name
    saved = out / "bench.json"
    kept = Path(args.archive) / name if args.archive and Path(args.archive) != Path(args.out) else None
    if saved.is_file():
        if kept is not None and not (kept / "bench.json").is_file():
            archive(out, kept)  # finished before --archive was given, or its copy was cut short
        return checked(load_saved(out), out, args)
    if kept is not None and (kept / "bench.json").is_file():
        return checked(load_saved(kept), kept, args)
    if args.no_run:
        print(f"  {name:30s} not run (--no-run)", flush=True)
        return None
    for attempt in (1, 2):
        if out.exists():  # an unfinished run (the bench was stopped): start it again
            shutil.rmtree(out)
        cmd = [
            "bash",
            str(ROOT / "launch.sh"),
            *args.preset,
            *launch_mode(mode, eta),
            "--staleness.eta",
            str(eta),
            "--steps",
            str(args.steps),
            "--seed",
            str(seed),
            "--data.seed",
            str(seed),
            "--eval.n",
            str(args.eval_n),
            "--eval.every",
            str(args.eval_every),
            "--log.run-dir",
            args.out,
            "--log.name",
            name,
            "--log.no-progress",
            "--checkpoint.every",
            "0",
            *extra,
        ]
        loads, t0 = [os.getloadavg()[0]], time.monotonic()
        log = Path(args.out) / f"{name}.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, STALEFLOW_MAX_RESTARTS="0")
            )
            while True:  # the machine load the run saw: the 1-minute load average every LOAD_EVERY_S
                try:
                    returncode = proc.wait(timeout=LOAD_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    loads.append(os.getloadavg()[0])
        wall = time.monotonic() - t0
        loads.append(os.getloadavg()[0])
        if returncode == 0 and (out / "metrics.jsonl").is_file():
            meta = {
                "name": name,
                "mode": mode,
                "eta": eta,
                "seed": seed,
                "wall_s": wall,
                "load_start": loads[0],
                "load_end": loads[-1],
                "load_mean": fmean(loads),
                "load_max": max(loads),
                "load_samples": len(loads),
            }
            result = {**meta, **summarize_run(out, wall)}
            if result["evals"] and result["evals"][-1]["step"] == args.steps:
                saved.write_text(json.dumps(meta))  # only what the run folder cannot give back
                if not args.keep_models:  # ~2 GB a run: a 15-run bench would fill a small disk
                    for heavy in ("checkpoints", "hf"):
                        shutil.rmtree(out / heavy, ignore_errors=True)
                if kept is not None:
                    archive(out, kept)
                return result
        print(
            f"  {name}: attempt {attempt} failed (exit {returncode}); log {log}:\n{log.read_text()[-1500:]}",
            file=sys.stderr,
            flush=True,
        )
    return None


def archive(out: Path, kept: Path) -> None:
    """Copy a finished run's record (~0.1 MB, small enough to commit) to `kept`, each file whole (written
    aside, then renamed) and bench.json last: a record is read only once its bench.json is there."""
    kept.mkdir(parents=True, exist_ok=True)
    for f in sorted(RECORD, key=lambda f: f == "bench.json"):
        if (out / f).is_file():
            shutil.copy2(out / f, kept / f"{f}.part")
            os.replace(kept / f"{f}.part", kept / f)


def checked(result: dict, where: Path, args) -> dict:
    """A saved run read back must be a run of this bench's recipe (its last evaluation at --steps)."""
    last = result["evals"][-1] if result["evals"] else {"step": None, "n": None}
    if last["step"] != args.steps or last["n"] != args.eval_n:
        raise SystemExit(
            f"{where}: a saved run of {last['step']} steps evaluated on {last['n']} prompts, not --steps "
            f"{args.steps} --eval-n {args.eval_n}: give the recipe it was run with, or another --out / --archive"
        )
    return result


BENCH_FIELDS = {
    "name": records.text(200),
    "mode": records.text(100),
    "eta": records.integer(0, 1 << 20),
    "seed": records.integer(0, 1 << 63),
    "wall_s": records.number(0, records.SECONDS),
    **{k: records.number(0, 1e6) for k in ("load_start", "load_end", "load_mean", "load_max")},
    "load_samples": records.integer(0, 1 << 40),
}
"""bench.json's fields, typed (metrics/records.py): a saved run read back may come from another machine."""


def load_saved(out: Path) -> dict:
    """A finished run: its wall time and load from bench.json (an older bench.json holds more; only
    these are kept), everything else derived again from its metrics.jsonl. Every record is typed: a
    crafted one stops the bench in one line naming the file and the field (SystemExit)."""
    try:
        meta = records.read_object(out / "bench.json", BENCH_FIELDS, ("wall_s", "load_start", "load_end"))
        meta = {k: meta[k] for k in SAVED if k in meta}
        meta.setdefault("load_mean", (meta["load_start"] + meta["load_end"]) / 2)
        meta.setdefault("load_max", max(meta["load_start"], meta["load_end"]))
        return {**meta, **summarize_run(out, meta["wall_s"])}
    except records.RecordError as e:
        raise SystemExit(f"bench_convergence: {e}") from None


def args_n(results: dict, key) -> int:
    return results[key][0]["evals"][-1]["n"]


def equivalence_lines(results: dict, margin: float) -> tuple[list[str], dict]:
    """TOST lines for StaleFlow at each eta run against sync, AReaL at that (nominal) eta, and the peer held
    to the same per-trajectory bound (verl-fully-async-matched at that eta), where both sides have runs."""
    lines, out = [], {}
    etas = sorted(eta for mode, eta in results if mode == "staleflow")
    pairs = [
        (("staleflow", e), b) for e in etas for b in (("verl-sync", 0), ("areal", e), ("verl-fully-async-matched", e))
    ]
    for a, b in pairs:
        e = equivalence(results, a, b, margin)
        if e is None:
            continue
        out[f"{label(*a)} - {label(*b)}"] = e
        verdict = "EQUIVALENT within" if e["equivalent"] else "not shown equivalent within"
        lines.append(
            f"{label(*a)} - {label(*b)}: final accuracy {e['mean']:+.3f}, 90% t interval [{e['ci'][0]:+.3f}, "
            f"{e['ci'][1]:+.3f}], TOST p {e['p']:.3f}: {verdict} +-{margin} ({e['seeds']} seeds; per-seed sd "
            f"{e['sd']:.3f}: 80% power needs {e['seeds_to_detect']} seeds to detect {margin}, "
            f"{e['seeds_for_equivalence']} to show equivalence if the true difference is 0)"
        )
        if "sd_eval" in e:
            lines.append(
                f"  of that sd: evaluation noise {e['sd_eval']:.3f} (per-prompt answers, {args_n(results, a)} "
                f"prompts), run-to-run {e['sd_train']:.3f}; with 4x the held-out prompts the sd would be "
                f"{e['sd_at_4x_eval_n']:.3f}: {e['seeds_to_detect_at_4x_eval_n']} seeds to detect {margin}"
            )
    return lines, out


def _ci(ci, fmt: str) -> str:
    return f"[{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def _num(v, fmt: str) -> str:
    return fmt.format(v) if v is not None else f"{'-':>{len(fmt.format(0.0))}s}"


def _span(vals: list) -> str:
    """Per-run counts: '26-32' over seeds (one value when they agree)."""
    return f"{min(vals)}-{max(vals)}" if min(vals) != max(vals) else f"{vals[0]}"


def table(stats: dict, target: float) -> str:
    w = max([24] + [len(label(*k)) for k in stats])  # the mode column fits the longest label
    v = max(w, 32)
    head = (
        f"{'mode':{w}s} {'seeds':>5s} {'acc@0':>6s} {'final mean':>10s} {'std':>6s} {'diff vs sync [95% CI]':>25s} "
        f"{'wall s':>7s} {'x sync':>6s} {'stale mean/max':>14s} {'time-to-target s':>18s} {'x sync':>6s}"
    )
    lines = [head]
    for (mode, eta), s in stats.items():
        ci = (
            f"[{s['diff_ci95'][0]:+.3f}, {s['diff_ci95'][1]:+.3f}]"
            if s["diff_ci95"]
            else "(baseline)"
            if mode == "verl-sync"
            else "(1 seed: no CI)"
        )
        ttt = (
            f"{s['ttt_s']:.0f} ({s['ttt_reached']}/{s['seeds']})"
            if s["ttt_s"] is not None
            else f"not reached (0/{s['seeds']})"
        )
        ratio = f"{s['ttt_vs_sync']:.2f}" if s["ttt_vs_sync"] is not None else "-"
        lines.append(
            f"{label(mode, eta):{w}s} {s['seeds']:5d} {s['acc_start']:6.3f} {s['acc_final_mean']:10.3f} "
            f"{s['acc_final_std']:6.3f} {s['diff_vs_sync']:+8.3f} {ci:>16s} {s['wall_s']:7.0f} "
            f"{s['wall_vs_sync']:6.2f} {s['staleness_mean']:9.2f} / {s['staleness_max']:<2d} {ttt:>18s} {ratio:>6s}"
        )
    lines.append(
        f"\n{'diagnostics (mean over steps)':{v}s} {'token stale':>11s} {'IS truncated':>12s} {'PPO clipped':>11s} "
        f"{'KL(behav||cur)':>14s} {'entropy':>8s} {'> eta':>8s} {'train acc last5':>15s}"
    )
    for (mode, eta), s in stats.items():
        d = s["diag"]
        if d:
            over = f"{s['over_eta']}/{s['groups']}"
            lines.append(
                f"{label(mode, eta):{v}s} {d['token_staleness_mean']:11.2f} {d['is_truncated_frac_mean']:12.4f} "
                f"{d['ppo_clipped_frac_mean']:11.4f} {d['behaviour_k3_mean']:14.2e} {d['entropy_mean']:8.3f} "
                f"{over:>8s} {d['train_acc_last5']:15.3f}"
            )
    lines.append(
        f"\n{'paired vs sync':{w}s} {'final accuracy diff [95% t]':>30s} {'time-to-target diff s [95% t]':>34s} "
        f"{'first: it / sync / neither':>26s} {'sign p':>6s} {'step':>5s}"
    )
    for (mode, eta), s in stats.items():
        if mode == "verl-sync":
            continue
        acc = f"{s['diff_vs_sync']:+.3f} " + (_ci(s["diff_ci95"], "{:+.3f}") if s["diff_ci95"] else "(no CI)")
        ttt = (
            f"{s['ttt_diff_vs_sync']:+.0f} " + (_ci(s["ttt_diff_ci95"], "{:+.0f}") if s["ttt_diff_ci95"] else "(no CI)")
            if s["ttt_diff_vs_sync"] is not None
            else "-"
        )
        ttt += f" ({s['ttt_paired_seeds']} seeds)"
        first = " / ".join(str(n) for n in s["ttt_first"])
        lines.append(
            f"{label(mode, eta):{w}s} {acc:>30s} {ttt:>34s} {first:>26s} {s['ttt_sign_p']:6.2f} "
            f"{_num(s['ttt_step'], '{:5.1f}')}"
        )
    lines.append(
        f"\n{'mechanics (metrics.jsonl)':{w}s} {'KL median':>9s} {'trainer s':>9s} {'interrupts':>10s} "
        f"{'migrations':>10s} {'mixed tok':>9s} {'tok stale':>9s} {'load mean / max':>15s}"
    )
    for (mode, eta), s in stats.items():
        m = s["mech"]
        lines.append(
            f"{label(mode, eta):{w}s} {_num(m['kl_median'], '{:9.2e}')} {m['trainer_s']:9.0f} "
            f"{_span(m['interrupts']):>10s} {_span(m['migrations']):>10s} {_num(m['mixed_token_frac'], '{:9.4f}')} "
            f"{_num(m['token_staleness'], '{:9.2f}')} {s['load']:7.1f} / {s['load_max']:<5.1f}"
        )
    sync_step = _num(stats.get(("verl-sync", 0), {}).get("ttt_step"), "{:.1f}")
    lines.append(
        f"target = sync's mean final accuracy - {TARGET_MARGIN} = {target:.3f}; time-to-target counts from "
        f"the start of each run's metrics (model loaded) to the version that first reached it; first: in how many "
        f"seeds the mode reached it before its sync pair (an unreached run loses), exact sign test; step: the "
        f"mean version that reached it (runs that did), sync's {sync_step}"
    )
    return "\n".join(lines)


def plot(results: dict, stats: dict, target: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for key, runs in results.items():
        if not runs:
            continue
        steps = sorted({e["step"] for e in runs[0]["evals"]})
        at = [[next(e for e in r["evals"] if e["step"] == s) for r in runs] for s in steps]
        acc = [fmean(e["accuracy"] for e in col) for col in at]
        sd = [pstdev([e["accuracy"] for e in col]) if len(col) > 1 else 0.0 for col in at]
        t = [fmean(e["t_policy"] for e in col) / 60 for col in at]
        lab = f"{label(*key)} ({len(runs)} seeds)"
        for ax, x in ((a1, t), (a2, steps)):
            (line,) = ax.plot(x, acc, "o-", label=lab)
            ax.fill_between(
                x,
                [a - s for a, s in zip(acc, sd)],
                [a + s for a, s in zip(acc, sd)],
                color=line.get_color(),
                alpha=0.15,
            )
    for ax, xl in ((a1, "wall time since the run started (min)"), (a2, "step (weight version)")):
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.3f}")
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out accuracy (greedy), mean over seeds +- 1 std")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=DEFAULT_MODES, help="mode[:eta] list; verl-sync (eta 0) is the baseline")
    ap.add_argument("--seeds", default="0,1,2", help="0,1,2 or a range 0-7 (inclusive), or both: 0-3,8")
    ap.add_argument("--margin", type=float, default=0.05, help="equivalence margin of the TOST statement")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-n", type=int, default=128)
    ap.add_argument("--out", default="runs/convergence")
    ap.add_argument(
        "--keep-models",
        action="store_true",
        help="keep each finished run's checkpoints/ and hf/ (default: deleted once its result is saved)",
    )
    ap.add_argument(
        "--archive",
        default=None,
        help="also keep each finished run's record (bench.json, metrics.jsonl, trained.jsonl, config.json, timeline.jsonl) in "
        "ARCHIVE/NAME, and read a run from there when --out lacks it: a study committed to the repository "
        "resumes on another machine (docs/results/)",
    )
    ap.add_argument(
        "--no-run", action="store_true", help="start no run: report the finished ones (in --out or --archive)"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny preset, 2 steps, 1 seed, 4 prompts, 2 modes")
    args = ap.parse_args(argv)
    args.out, args.preset = os.path.abspath(args.out), []  # launch.sh runs in the repository root
    args.archive = os.path.abspath(args.archive) if args.archive else None
    if args.smoke:
        args.preset, args.steps, args.eval_every, args.eval_n = ["--preset", "tiny"], 2, 1, 4
        args.seeds, args.modes = "0", "verl-sync,staleflow:1"
    modes, seeds = parse_modes(args.modes), parse_seeds(args.seeds)
    os.makedirs(args.out, exist_ok=True)
    print(
        f"hardware: {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; "
        f"{args.steps} steps, held-out {args.eval_n} prompts every {args.eval_every} steps, seeds {seeds}; "
        f"extra flags: {' '.join(args.preset + extra) or 'none'}",
        flush=True,
    )
    results: dict[tuple[str, int], list[dict]] = {key: [] for key in modes}
    for seed in seeds:
        for mode, eta in modes:
            name = f"{mode}-eta{eta}-seed{seed}"
            r = run_one(name, mode, eta, seed, args, extra)
            if r is None:
                continue
            results[(mode, eta)].append(r)
            e0, e1 = r["evals"][0], r["evals"][-1]
            print(
                f"  {name:30s} held-out {e0['accuracy']:.3f} -> {e1['accuracy']:.3f} "
                f"[{e1['ci95_low']:.3f}, {e1['ci95_high']:.3f}]  wall {r['wall_s']:.0f} s  staleness mean "
                f"{r['staleness_mean']:.2f} max {r['staleness_max']}  load mean {r['load_mean']:.1f} max {r['load_max']:.1f}",
                flush=True,
            )
    if not results[("verl-sync", 0)]:
        raise SystemExit("no verl-sync run finished: nothing to compare against")
    target, stats = aggregate(results, ("verl-sync", 0))
    print("\n" + table(stats, target))
    eq_lines, eq = equivalence_lines(results, args.margin)
    if eq_lines:
        print(f"\nequivalence of final held-out accuracy (two one-sided t tests at +-{args.margin}, paired by seed):")
        print("\n".join(eq_lines))
    png = os.path.join(args.out, "convergence.png")
    plot(
        results,
        stats,
        target,
        png,
        f"Held-out accuracy vs wall time ({cpu_name()}, {os.cpu_count()} cores, {args.eval_n} prompts, seeds {seeds})",
    )
    print(f"wrote {png}")
    print(json.dumps({"target": target, **{label(*k): v for k, v in stats.items()}, "equivalence": eq}))


if __name__ == "__main__":
    main()
