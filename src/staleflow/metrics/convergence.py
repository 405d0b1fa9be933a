"""Summaries of convergence runs with statistics: what ``scripts/bench_convergence.py`` derives from
each run folder's metrics.jsonl and aggregates over seeds (paired with sync by seed).

    run = summarize_run(Path("runs/convergence/staleflow-eta1-seed0"), wall_s=639.0)
    target, stats = aggregate({("verl-sync", 0): [...], ("staleflow", 1): [...]}, ("verl-sync", 0))
    equivalence(results, ("staleflow", 1), ("verl-sync", 0), margin=0.05)   # TOST + seeds needed
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import fmean, median, stdev

from staleflow.metrics.stats import paired_seeds_needed, sign_test, t_interval, tost, tost_seeds_needed

TARGET_MARGIN = 0.02
"""Time-to-target's target: sync's mean final held-out accuracy minus this."""
DIAG = ("token_staleness_mean", "is_truncated_frac_mean", "ppo_clipped_frac_mean", "behaviour_k3_mean", "entropy_mean")
"""Off-policy diagnostics from the trainer (mean over steps): why a mode learns less, if it does."""


def label(mode: str, eta: int) -> str:
    return mode if mode == "verl-sync" else f"{mode} eta {eta}"


def summarize_run(run_dir: Path, wall_s: float) -> dict:
    """The numbers the bench needs from one finished run folder (metrics.jsonl)."""
    from staleflow.metrics.records import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")  # typed; RecordError (one line) for a crafted record
    steps = sorted((r for r in rows if "eval_n" not in r), key=lambda r: r["step"])
    made = {0: 0.0, **{r["step"] + 1: r["time"] for r in steps}}  # version v exists once buffer v-1 is trained
    evals = [
        {
            "step": r["step"],
            "accuracy": r["eval_accuracy"],
            "ci95_low": r["eval_ci95_low"],
            "ci95_high": r["eval_ci95_high"],
            "n": r["eval_n"],
            "t_policy": made.get(r["step"], r["time"]),
            "correct": r.get("eval_correct"),  # "1011...": per held-out prompt (absent in older runs)
        }
        for r in sorted((r for r in rows if "eval_n" in r), key=lambda r: r["step"])
    ]
    hist: dict[int, int] = {}
    for r in steps:
        for k, n in (r.get("staleness_hist") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + n
    groups = sum(hist.values())
    train = [r.get("train", {}) for r in steps]
    tokens = [t.get("response_tokens", 0.0) for t in train]

    def token_mean(key: str) -> float | None:  # a per-token mean of the trainer's, over the run's tokens
        have = [(t[key], w) for t, w in zip(train, tokens) if key in t]
        return sum(v * w for v, w in have) / max(sum(w for _, w in have), 1e-12) if have else None

    k3 = [t["behaviour_k3_mean"] for t in train if "behaviour_k3_mean" in t]
    last = steps[-1] if steps else {}
    return {
        "wall_s": wall_s,
        "evals": evals,
        "steps": len(steps),
        # mechanics, all from metrics.jsonl (interrupts / migrations / pulls are running totals)
        "k3_steps": k3,
        "kl_median": median(k3) if k3 else None,
        "trainer_s": sum(r.get("train_s", 0.0) for r in steps),
        "interrupts": last.get("interrupts", 0),
        "migrations": last.get("migrations", 0),
        "pulls": last.get("pulls", 0),
        "mixed_token_frac": token_mean("mixed_token_frac"),
        "token_staleness": token_mean("token_staleness_mean"),
        "staleness_mean": sum(k * n for k, n in hist.items()) / max(groups, 1),
        "staleness_max": max(hist, default=0),
        "staleness_hist": hist,
        "reward_last5": fmean(r.get("reward_mean", 0.0) for r in steps[-5:]) if steps else 0.0,
        "diag": {k: fmean(r.get("train", {}).get(k, 0.0) for r in steps) if steps else 0.0 for k in DIAG}
        | {"train_acc_last5": fmean(r.get("accuracy", 0.0) for r in steps[-5:]) if steps else 0.0},
    }


def _first_reached(run: dict, target: float) -> dict | None:
    """The first evaluation whose accuracy reached the target (None: never)."""
    return next((e for e in run["evals"] if e["accuracy"] >= target - 1e-12), None)


def time_to_target(run: dict, target: float) -> float | None:
    """Seconds since the run started at which the first evaluated policy reached the target."""
    e = _first_reached(run, target)
    return e["t_policy"] if e else None


def step_to_target(run: dict, target: float) -> int | None:
    """The first evaluated policy version (trained steps) that reached the target: no wall clock in it."""
    e = _first_reached(run, target)
    return e["step"] if e else None


def first_to_target(pairs: list[tuple[float | None, float | None]]) -> list[int]:
    """[a first, b first, neither or tied] over paired times-to-target (None: never reached). A run
    that reached the target beats its pair that did not, so unreached (censored) runs still count."""
    out = [0, 0, 0]
    for a, b in pairs:
        if a is not None and (b is None or a < b):
            out[0] += 1
        elif b is not None and (a is None or b < a):
            out[1] += 1
        else:
            out[2] += 1
    return out


def aggregate(results: dict[tuple[str, int], list[dict]], sync_key) -> tuple[float, dict]:
    """(target, per-mode statistics); paired differences use the seeds both runs finished."""
    sync = {r["seed"]: r for r in results[sync_key]}
    target = fmean(r["evals"][-1]["accuracy"] for r in sync.values()) - TARGET_MARGIN
    sync_wall = fmean(r["wall_s"] for r in sync.values())
    sync_ttt = [t for t in (time_to_target(r, target) for r in sync.values()) if t is not None]
    stats = {}
    for key, runs in results.items():
        if not runs:
            continue
        final = [r["evals"][-1]["accuracy"] for r in runs]
        diffs = [
            r["evals"][-1]["accuracy"] - sync[r["seed"]]["evals"][-1]["accuracy"] for r in runs if r["seed"] in sync
        ]
        ci = t_interval(diffs) if key != sync_key else None
        eta = key[1]
        ttt = [t for t in (time_to_target(r, target) for r in runs) if t is not None]
        both = [(time_to_target(r, target), time_to_target(sync[r["seed"]], target)) for r in runs if r["seed"] in sync]
        ttt_d = [x - y for x, y in both if x is not None and y is not None]
        ttt_ci = t_interval(ttt_d) if key != sync_key else None
        first = first_to_target(both)
        steps_to = [t for t in (step_to_target(r, target) for r in runs) if t is not None]
        groups = sum(sum(r["staleness_hist"].values()) for r in runs)
        stats[key] = {
            "seeds": len(runs),
            "acc_start": fmean(r["evals"][0]["accuracy"] for r in runs),
            "acc_final_mean": fmean(final),
            "acc_final_std": stdev(final) if len(final) > 1 else 0.0,
            "diff_vs_sync": fmean(diffs) if diffs and key != sync_key else 0.0,
            "diff_ci95": list(ci) if ci else None,
            "paired_seeds": len(diffs),
            "wall_s": fmean(r["wall_s"] for r in runs),
            "wall_vs_sync": fmean(r["wall_s"] for r in runs) / sync_wall,
            "staleness_mean": sum(sum(int(k) * n for k, n in r["staleness_hist"].items()) for r in runs)
            / max(groups, 1),
            "staleness_max": max(r["staleness_max"] for r in runs),
            # groups trained beyond eta, all seeds (from the histogram: metrics.jsonl's over_eta is a
            # running total, not a per-step count)
            "over_eta": sum(n for r in runs for k, n in r["staleness_hist"].items() if int(k) > eta),
            "groups": groups,
            "ttt_s": fmean(ttt) if ttt else None,
            "ttt_reached": len(ttt),
            "ttt_vs_sync": fmean(ttt) / fmean(sync_ttt) if ttt and sync_ttt and fmean(sync_ttt) > 0 else None,
            "ttt_diff_vs_sync": fmean(ttt_d) if ttt_d and key != sync_key else None,
            "ttt_diff_ci95": list(ttt_ci) if ttt_ci else None,
            "ttt_paired_seeds": len(ttt_d),
            # censored pairs count too: which of the pair reached the target first (an unreached run loses)
            "ttt_first": first if key != sync_key else None,
            "ttt_sign_p": sign_test(first[0], first[1]) if key != sync_key else None,
            "ttt_step": fmean(steps_to) if steps_to else None,
            "load": fmean(r.get("load_mean", (r["load_start"] + r["load_end"]) / 2) for r in runs),
            "load_max": max(r.get("load_max", max(r["load_start"], r["load_end"])) for r in runs),
            "diag": {k: fmean(r["diag"][k] for r in runs) for k in runs[0].get("diag", {})},
            "mech": mechanics(runs),
        }
    return target, stats


def mechanics(runs: list[dict]) -> dict:
    """What docs/perf.md quotes about how a mode ran, from the runs' metrics.jsonl (over its seeds)."""
    k3 = [v for r in runs for v in r.get("k3_steps", [])]
    mixed = [r["mixed_token_frac"] for r in runs if r.get("mixed_token_frac") is not None]
    tok = [r["token_staleness"] for r in runs if r.get("token_staleness") is not None]
    return {
        "kl_median": median(k3) if k3 else None,
        "trainer_s": fmean(r.get("trainer_s", 0.0) for r in runs),
        "interrupts": [r.get("interrupts", 0) for r in runs],
        "migrations": [r.get("migrations", 0) for r in runs],
        "mixed_token_frac": fmean(mixed) if mixed else None,
        "token_staleness": fmean(tok) if tok else None,
    }


def equivalence(results: dict, a, b, margin: float) -> dict | None:
    """TOST on the per-seed final-accuracy differences a - b (seeds both finished), and the seeds a
    paired study needs at their observed spread: to detect `margin`, and to show equivalence within it."""
    rb = {r["seed"]: r for r in results.get(b, [])}
    pairs = [(r, rb[r["seed"]]) for r in results.get(a, []) if r["seed"] in rb]
    d = [x["evals"][-1]["accuracy"] - y["evals"][-1]["accuracy"] for x, y in pairs]
    res = tost(d, margin)
    if res is None:
        return None
    sd = stdev(d)
    res["seeds"], res["sd"] = len(d), sd
    res["seeds_to_detect"] = paired_seeds_needed(sd, margin) if sd > 0 else 2
    res["seeds_for_equivalence"] = tost_seeds_needed(sd, margin) if sd > 0 else 2
    noise = [eval_noise_var(x["evals"][-1], y["evals"][-1]) for x, y in pairs]
    if noise and None not in noise:  # split the spread: evaluation noise vs run-to-run (training) spread
        var_eval = fmean(noise)
        var_train = max(sd * sd - var_eval, 0.0)
        sd4 = math.sqrt(var_train + var_eval / 4)
        res |= {"sd_eval": math.sqrt(var_eval), "sd_train": math.sqrt(var_train), "sd_at_4x_eval_n": sd4}
        res["seeds_to_detect_at_4x_eval_n"] = paired_seeds_needed(sd4, margin) if sd4 > 0 else 2
    return res


def eval_noise_var(ea: dict, eb: dict) -> float | None:
    """Variance of one paired accuracy difference that comes from evaluating on a finite held-out set:
    s^2 / n of the per-prompt differences (1 - 0, 0 - 1 or 0), from the two runs' per-prompt answers to
    the same prompts. None when a run did not record them."""
    x, y = ea.get("correct"), eb.get("correct")
    if not x or not y or len(x) != len(y) or len(x) < 2:
        return None
    z = [int(p) - int(q) for p, q in zip(x, y)]
    return stdev(z) ** 2 / len(z)
