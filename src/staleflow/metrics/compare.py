"""Compare what the trainer saw in two runs, or two sets of runs paired by seed: the analysis behind
``scripts/compare_runs.py`` (its docstring lists the quantities and the intervals).

    runs_a, runs_b = [load_run("runs/sf-seed0")], [load_run("runs/areal-seed0")]
    rows = compare(runs_a, runs_b)   # [{"key", "label", "unit", "a", "b", "diff", "ci95", "method", "n"}, ...]

A run is read from its trained.jsonl (one row per trained group, runtime/job.py) and metrics.jsonl
(one row per step, plus evaluation rows), rows marked superseded left out. Each quantity is a
reducer over units (trained groups, steps, or the run itself) of (numerator, denominator) pairs,
so a share of tokens is a ratio of sums whichever groups a bootstrap draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from staleflow.metrics.stats import spearman, t_interval
from staleflow.metrics.writer import read_jsonl

N_BOOT = 2000


@dataclass
class Quantity:
    key: str
    label: str
    unit: str  # "group" | "step" | "run"
    reduce: str = "ratio"  # "ratio": sum(num) / sum(den) over units; "median": median of num / den; "max"


class RunError(ValueError):
    """A run folder that cannot be compared (missing, empty, malformed)."""


def _rows(path: Path) -> list[dict]:
    return [r for r in read_jsonl(str(path)) if not r.get("superseded")]


def load_run(path: str | Path) -> dict:
    """One run folder -> {"name", "seed", "groups": [per-group dict], "steps": [...], "run": {...}}."""
    from staleflow.metrics import records
    from staleflow.metrics.settings import run_settings
    from staleflow.metrics.walltime import breakdown

    p = Path(path)
    if not (p / "trained.jsonl").exists() or not (p / "metrics.jsonl").exists():
        raise RunError(f"{p}: no trained.jsonl / metrics.jsonl: pass a run folder (--log.run-dir/--log.name)")
    try:  # typed: a crafted record is one line naming file, line and field (metrics/records.py)
        trained, metrics = records.read_trained(p / "trained.jsonl"), records.read_metrics(p / "metrics.jsonl")
        cfg = records.read_config(p)
        seed = records.read_seed(p, cfg)
        spans = records.read_timeline(p / "timeline.jsonl") if (p / "timeline.jsonl").exists() else None
        bench = (
            records.read_object(p / "bench.json", {"load_mean": records.number(0, 1e6)}, ())
            if (p / "bench.json").exists()
            else {}
        )
    except records.RecordError as e:
        raise RunError(str(e)) from None
    try:
        settings = run_settings(cfg)
    except (ValueError, RecursionError) as e:  # too many settings, or nested too deep to flatten
        raise RunError(f"{p / 'config.json'}: {e}") from None
    steps = sorted((r for r in metrics if "eval_n" not in r), key=lambda r: r["step"])
    evals = sorted((r for r in metrics if "eval_n" in r), key=lambda r: r["step"])
    if not trained or not steps:
        raise RunError(f"{p}: no trained groups or no steps in its logs: did the run train?")
    step_time = {r["step"]: r["time"] for r in steps}
    times = [r["time"] for r in steps]
    monotone = all(a <= b for a, b in zip(times, times[1:]))  # a resumed run restarts its clock

    def version_at(t: float) -> int:
        done = [r["step"] for r in steps if r["time"] <= t]
        return max(done) + 1 if done else steps[0]["step"]

    trained.sort(key=lambda r: (r["buffer"], r["group_id"]))
    by_id = sorted(range(len(trained)), key=lambda i: trained[i]["group_id"])
    sub_rank = {i: k for k, i in enumerate(by_id)}
    # overtaken: some group drawn later (larger id) was trained in an earlier buffer
    later_min, overtaken = math.inf, {}
    for i in reversed(by_id):
        overtaken[i] = later_min < trained[i]["buffer"]
        later_min = min(later_min, trained[i]["buffer"])
    groups = []
    for i, r in enumerate(trained):
        b, V, rewards = r["buffer"], r["traj_version"], r["rewards"]
        mean = sum(rewards) / len(rewards)
        g = {
            "buffer": b,
            "group_id": r["group_id"],
            "prompt_id": r.get("prompt_id"),
            "traj_version": V,
            "staleness": b - V,
            "members": len(rewards),
            "reward_mean": mean,
            "reward_var": sum((x - mean) ** 2 for x in rewards) / len(rewards),
            "order_lag": i - sub_rank[i],
            "overtaken": overtaken[i],
        }
        if "n_tokens" in r:
            g["tokens"] = sum(r["n_tokens"])
        if r.get("token_versions"):
            hist: dict[int, int] = {}
            for member in r["token_versions"]:
                for v, n in member:
                    hist[b - v] = hist.get(b - v, 0) + n
            g["token_staleness"] = hist
            g["tokens"] = sum(hist.values())
            g["tokens_newer"] = sum(n for member in r["token_versions"] for v, n in member if v > V)
            g["mixed_members"] = sum(len(member) > 1 for member in r["token_versions"])
        if "submitted_s" in r and monotone and b in step_time:
            g["submit_to_train_s"] = step_time[b] - r["submitted_s"]
            g["queue_steps"] = b - version_at(r["submitted_s"])
        groups.append(g)
    last = steps[-1]
    run = {
        "final_accuracy": evals[-1]["eval_accuracy"] if evals else None,
        "interrupts": last.get("interrupts"),
        "migrations": last.get("migrations"),
        "pulls": last.get("pulls"),
        "groups_aborted": last.get("groups_aborted"),
        "occupy_exchanges": last.get("occupy_exchanges"),  # StaleFlow's protocol only (absent: the peers, older runs)
        "order_swaps": last.get("order_swaps"),
        "order_spearman": spearman([g["group_id"] for g in groups], [g["buffer"] for g in groups]),
        "load_mean": bench.get("load_mean"),  # bench_convergence.py's machine load during the run
        **(breakdown(steps, evals, spans) if monotone else {}),  # a resumed run's clock restarts
    }
    return {
        "name": p.name,
        "path": str(p),
        "seed": seed,
        "settings": settings,
        "groups": groups,
        "steps": steps,
        "evals": evals,
        "run": run,
    }


# ---- quantities ------------------------------------------------------------------------------------
STEP_TOKEN_MEANS = (
    ("is_ratio_mean", "importance ratio pi/mu, mean over tokens"),
    ("is_truncated_frac_mean", "share of importance weights truncated"),
    ("ppo_clipped_frac_mean", "share of tokens PPO-clipped"),
    ("behaviour_k3_mean", "KL(behaviour || current) k3, token mean"),
    ("entropy_mean", "entropy, token mean"),
    ("mixed_token_frac", "share of tokens newer than their response's first (trainer)"),
)


WALL_ROWS = (
    ("wall_s", "wall seconds to the last step"),
    ("trainer_busy_s", "trainer busy seconds (compute + push)"),
    ("trainer_wait_s", "trainer waiting seconds (no batch yet)"),
    ("trainer_busy_share", "trainer busy share of the wall time"),
    ("trainer_ms_per_token", "trainer ms per trained token (core sharing)"),
    ("step_gap_cv", "step rhythm: sd / mean of the seconds between steps"),
    ("step_gap_cv_all", "step rhythm, evaluations' gaps kept"),
    ("eval_s", "held-out evaluation seconds (beside rollout)"),
    ("rollout_busy_share", "rollout instances' busy share (timeline)"),
    ("pull_s", "weight pull seconds, all ranks (timeline)"),
    ("load_mean", "machine load mean (bench.json)"),
)
"""Where the wall time went (metrics/walltime.py); a row is left out where no run has its data."""


def quantities(runs: list[dict]) -> list[Quantity]:
    """The rows to compare; staleness rows for every staleness any run saw, optional fields when present."""
    gs = [g for r in runs for g in r["groups"]]
    stale = sorted({g["staleness"] for g in gs})
    tok_stale = sorted({s for g in gs for s in g.get("token_staleness", {})})
    has = lambda key: any(key in g for g in gs)  # noqa: E731
    trains = [s.get("train", {}) for r in runs for s in r["steps"]]
    q = [Quantity("staleness", "group staleness (buffer - V_traj)", "group")]
    q += [Quantity(f"groups_stale_{s}", f"share of groups at staleness {s}", "group") for s in stale]
    if has("token_staleness"):
        q += [Quantity(f"tokens_stale_{s}", f"share of tokens at token staleness {s}", "group") for s in tok_stale]
        q += [
            Quantity("tokens_newer", "share of tokens newer than the group's V_traj", "group"),
            Quantity("mixed_members", "share of responses with mixed versions", "group"),
        ]
    if has("tokens"):
        q.append(Quantity("response_len", "response length (tokens)", "group"))
    q += [
        Quantity("reward_mean", "reward of trained responses", "group"),
        Quantity("reward_var", "group reward variance", "group"),
        Quantity("all_equal", "share of all-equal groups (no signal)", "group"),
        Quantity("overtaken", "share of groups overtaken by a later-drawn one", "group"),
        Quantity("order_lag_abs", "|training rank - drawing rank| (groups)", "group"),
    ]
    if has("queue_steps"):
        q += [
            Quantity("queue_steps", "steps from drawing the prompt to training it", "group"),
            Quantity("submit_to_train_s", "seconds from drawing the prompt to training it", "group"),
        ]
    q += [Quantity(k, lab, "step") for k, lab in STEP_TOKEN_MEANS if any(k in t for t in trains)]
    q += [
        Quantity("is_ratio_max", "importance ratio, max per step (mean over steps)", "step"),
        Quantity("is_ratio_max_all", "importance ratio, max over the run", "step", "max"),
        Quantity("k3_median", "KL(behaviour || current) k3, median over steps", "step", "median"),
        Quantity("grad_norm", "gradient norm", "step"),
        Quantity("token_staleness_mean", "token staleness (trainer)", "step"),
        Quantity("train_s", "trainer seconds per step", "step"),
        Quantity("groups_dropped", "groups dropped per step (no signal)", "step"),
        Quantity("train_reward", "train reward per step", "step"),
    ]
    q += [
        Quantity(k, lab, "run", "value")
        for k, lab in (
            ("final_accuracy", "final held-out accuracy"),
            ("interrupts", "interrupts (run total)"),
            ("migrations", "migrations (run total)"),
            ("pulls", "pulls (run total)"),
            ("groups_aborted", "groups aborted (run total)"),
            ("occupy_exchanges", "occupy exchanges (run total)"),
            ("order_swaps", "train-order swaps (run total)"),
            ("order_spearman", "Spearman: drawing order vs training order"),
            *WALL_ROWS,
        )
    ]
    return q


def unit_values(run: dict, q: Quantity) -> tuple[np.ndarray, np.ndarray]:
    """(num, den) per unit of `run` for quantity q (its reducer turns them into one number)."""
    pairs: list[tuple[float, float]] = []
    if q.unit == "group":
        for g in run["groups"]:
            k = q.key
            if k.startswith("groups_stale_"):
                pairs.append((float(g["staleness"] == int(k.rsplit("_", 1)[1])), 1.0))
            elif k.startswith("tokens_stale_"):
                if "token_staleness" in g:
                    pairs.append((g["token_staleness"].get(int(k.rsplit("_", 1)[1]), 0), g["tokens"]))
            elif k == "tokens_newer":
                if "tokens_newer" in g:
                    pairs.append((g["tokens_newer"], g["tokens"]))
            elif k == "mixed_members":
                if "mixed_members" in g:
                    pairs.append((g["mixed_members"], g["members"]))
            elif k == "response_len":
                if "tokens" in g:
                    pairs.append((g["tokens"], g["members"]))
            elif k == "reward_mean":
                pairs.append((g["reward_mean"] * g["members"], g["members"]))
            elif k == "all_equal":
                pairs.append((float(g["reward_var"] == 0), 1.0))
            elif k == "order_lag_abs":
                pairs.append((abs(g["order_lag"]), 1.0))
            elif k in g:
                pairs.append((float(g[k]), 1.0))
    elif q.unit == "step":
        for s in run["steps"]:
            t = s.get("train", {})
            k = q.key
            if k in dict(STEP_TOKEN_MEANS):  # per-token means: weight each step by its trained tokens
                if k in t:
                    w = t.get("response_tokens", 1.0)
                    pairs.append((t[k] * w, w))
            elif k in ("is_ratio_max", "is_ratio_max_all"):
                if "is_ratio_max" in t:
                    pairs.append((t["is_ratio_max"], 1.0))
            elif k == "k3_median":
                if "behaviour_k3_mean" in t:
                    pairs.append((t["behaviour_k3_mean"], 1.0))
            elif k == "train_s":
                pairs.append((s.get("train_s", 0.0), 1.0))
            elif k == "train_reward":
                pairs.append((s.get("reward_mean", 0.0), 1.0))
            elif k in t:
                pairs.append((t[k], 1.0))
    else:
        v = run["run"].get(q.key)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            pairs.append((float(v), 1.0))
    a = np.asarray(pairs, dtype=float).reshape(-1, 2)
    return a[:, 0], a[:, 1]


def reduce(q: Quantity, num: np.ndarray, den: np.ndarray) -> float | None:
    if len(num) == 0:
        return None
    if q.reduce == "median":
        return float(np.median(num / den))
    if q.reduce == "max":
        return float(np.max(num / den))
    if q.reduce == "value":
        return float(num[0])
    return float(num.sum() / den.sum()) if den.sum() else None


def bootstrap_diff(q: Quantity, a: tuple, b: tuple, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of reduce(B) - reduce(A), each side's units resampled on their own."""
    rng = np.random.default_rng(seed)
    out = np.empty(n_boot)
    for i in range(n_boot):
        ia, ib = rng.integers(0, len(a[0]), len(a[0])), rng.integers(0, len(b[0]), len(b[0]))
        ra, rb = reduce(q, a[0][ia], a[1][ia]), reduce(q, b[0][ib], b[1][ib])
        out[i] = np.nan if ra is None or rb is None else rb - ra
    out = out[~np.isnan(out)]
    if not len(out):
        return float("nan"), float("nan")
    return float(np.percentile(out, 2.5)), float(np.percentile(out, 97.5))


def pair_runs(a: list[dict], b: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs by seed (the seeds both sides ran) when every run's seed is known and distinct on its
    side; otherwise by position, which needs as many runs on each side."""
    sa, sb = [r["seed"] for r in a], [r["seed"] for r in b]
    if None not in sa + sb and len(set(sa)) == len(sa) and len(set(sb)) == len(sb):
        by = {r["seed"]: r for r in b}
        pairs = [(r, by[r["seed"]]) for r in a if r["seed"] in by]
        if not pairs:
            raise RunError(f"no seed in common: A ran seeds {sorted(sa)}, B ran {sorted(sb)}")
        return pairs
    if len(a) != len(b):
        raise RunError(f"{len(a)} runs against {len(b)} and their seeds do not pair them: give as many on each side")
    return list(zip(a, b))


def same_prompt_steps(ra: dict, rb: dict) -> list[float]:
    """Per prompt trained in both runs: its buffer in B - its buffer in A."""
    at = {g["prompt_id"]: g["buffer"] for g in ra["groups"] if g["prompt_id"] is not None}
    return [g["buffer"] - at[g["prompt_id"]] for g in rb["groups"] if g["prompt_id"] in at]


def compare(runs_a: list[dict], runs_b: list[dict], n_boot: int = N_BOOT, seed: int = 0) -> list[dict]:
    pairs = pair_runs(runs_a, runs_b)
    out = []
    for q in quantities(runs_a + runs_b):
        va = [reduce(q, *unit_values(ra, q)) for ra, _ in pairs]
        vb = [reduce(q, *unit_values(rb, q)) for _, rb in pairs]
        ok = [(x, y) for x, y in zip(va, vb) if x is not None and y is not None]
        if not ok:
            continue
        row = {
            "key": q.key,
            "label": q.label,
            "unit": q.unit,
            "a": float(np.mean([x for x, _ in ok])),
            "b": float(np.mean([y for _, y in ok])),
            "diff": float(np.mean([y - x for x, y in ok])),
            "ci95": None,
            "method": "",
            "n": len(ok),
        }
        if len(pairs) > 1:
            ci = t_interval([y - x for x, y in ok])
            row["ci95"], row["method"] = (list(ci) if ci else None), f"t over {len(ok)} paired seeds"
        elif q.unit != "run":
            ua, ub = unit_values(pairs[0][0], q), unit_values(pairs[0][1], q)
            row["ci95"] = list(bootstrap_diff(q, ua, ub, n_boot, seed))
            row["method"] = f"bootstrap over {q.unit}s ({len(ua[0])} / {len(ub[0])})"
        else:
            row["method"] = "one run per side: no interval"
        out.append(row)
    per_pair = [same_prompt_steps(ra, rb) for ra, rb in pairs]
    if all(per_pair):
        means = [float(np.mean(d)) for d in per_pair]
        row = {
            "key": "same_prompt_step_diff",
            "label": "same prompt: its step in B - in A",
            "unit": "prompt",
            "a": None,
            "b": None,
            "diff": float(np.mean(means)),
            "n": len(per_pair),
        }
        if len(pairs) > 1:
            ci = t_interval(means)
            row["ci95"], row["method"] = (list(ci) if ci else None), f"t over {len(means)} paired seeds"
        else:
            d = np.asarray(per_pair[0], dtype=float)
            rng = np.random.default_rng(seed)
            boots = d[rng.integers(0, len(d), (n_boot, len(d)))].mean(axis=1)
            row["ci95"] = [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]
            row["method"] = f"bootstrap over {len(d)} prompts trained in both"
        out.append(row)
    return out
