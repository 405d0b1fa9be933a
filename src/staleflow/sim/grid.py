"""``staleflow sim --grid paper``: the evaluation grid, every mode at matched eta.

Axes (2 x 3 x 2 x 2 = 24 settings): a 7B-class and a 32B-class cost model (PSRL's Qwen2.5-7B TP1
and Qwen2.5-32B TP2 coefficients; KV capacity, prefill/train rates and weight-transfer times derived
from the model size and an H20, sim/hardware.py), eta in {1, 2, 3}, two response-length
distributions (lognormal and long-cot, sim/lengths.py) and two rollout:train splits of 128 GPUs
(64:64 and 96:32, the splits of verl's fully-async example scripts). Every setting runs verl-sync,
verl-one-step-off (their eta is fixed: 0 and 1), verl-fully-async, areal and staleflow (at the
setting's eta); the ablations (report.ABLATIONS) run at the grid centre, each over ABLATION_SEEDS
(ratio of the means). Per setting: staleflow over verl-sync and over the best asynchronous baseline
at the same eta (verl-one-step-off only counts at eta 1), staleflow's step time against its tail
floor, and, because the peers bound admission but not trajectories, staleflow
at the eta equal to each peer's OBSERVED worst staleness (matched worst case). Prints per-setting
tables and summaries, saves grid.png and grid.json, and ends with the JSON line {"vs_sync_max",
"vs_sync_avg", "vs_best_async_max", "vs_best_async_avg", "best_async", "ablation", "violations"}
(averages: arithmetic over the 24 settings; "best_async": the baseline best most often).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import Counter

from staleflow.coordinator.cost_model import load_cost_model
from staleflow.coordinator.modes import ASYNC_BASELINES
from staleflow.sim.config import SimConfig
from staleflow.sim.hardware import derive
from staleflow.sim.report import ABLATIONS, FIXED_ETA, best_async, find, ratio, table
from staleflow.sim.simulator import SimResult, run

MODELS = (("7B", "qwen2.5-7b-tp1", 1), ("32B", "qwen2.5-32b-tp2", 2))
ETAS = (1, 2, 3)
DISTS = ("lognormal", "long-cot")
SPLITS = ((64, 64), (96, 32))
MODES = ("verl-sync", "verl-one-step-off", "verl-fully-async", "areal", "staleflow")
CENTRE = ("32B", 2, "long-cot", (64, 64))
ABLATION_SEEDS = (0, 1, 2)
MAX_MATCHED_ETA = 6
"""Staleflow runs at a peer's observed worst staleness only up to this eta (bounds the grid's cost)."""


def tail_floor_s(cfg: SimConfig, eta: int, train_s: float, speed: float = 1.0) -> float:
    """A lower bound on the mean step time of any schedule that keeps EVERY trajectory within eta.

    Version V is published train + push after step V - 1 starts; a group tagged V starts no earlier
    and must be in buffer V + eta, whose training starts eta + 1 steps after step V - 1 started: so
    (eta + 1) x step >= train + push + the group's generation time. With a response at the length
    cap in (almost) every batch (the grid: 256 responses, 2-3% capped), generation >= that response
    decoded alone (n = 1) on the fastest instance (`speed`: its factor on the cost model; the
    per-stretch noise averages out over hundreds of stretches). The trainer also needs train per
    step: step >= max(train, (decode at the cap + train + push) / (eta + 1))."""
    cost = load_cost_model(cfg.cost_model)
    push = derive(cfg, cost).push_s
    return max(train_s, (cost.steps_time(1, cfg.prompt_len, cfg.max_response) * speed + train_s + push) / (eta + 1))


def mean_step(r: SimResult, warmup: int) -> float:
    steps = r.step_times[warmup:] or r.step_times
    return sum(steps) / max(1, len(steps))


def setting_cfg(base: SimConfig, cost_model: str, tp: int, dist: str, split: tuple[int, int]) -> SimConfig:
    return dataclasses.replace(base, cost_model=cost_model, gpus_per_instance=tp, length_dist=dist,
                               total_gpus=sum(split), rollout_gpus=split[0], out_dir="")


def run_setting(base: SimConfig, model: str, cost_model: str, tp: int, dist: str,
                split: tuple[int, int]) -> tuple[list[dict], list[SimResult], str]:
    """Every mode of one setting, staleflow at the peers' observed worst staleness: (rows, results, table)."""
    cfg = setting_cfg(base, cost_model, tp, dist, split)
    results = [run(cfg, mode, eta, {}, f"{mode} eta={eta}")
               for mode in MODES for eta in ([FIXED_ETA[mode]] if mode in FIXED_ETA else ETAS)]
    name = f"{model} {dist} {split[0]}:{split[1]}"
    matched = []  # staleflow at each peer's observed worst staleness
    for peer in [r for r in results if r.mode in ("verl-fully-async", "areal")]:
        worst = max(peer.staleness_hist, default=0)
        if worst > MAX_MATCHED_ETA:
            continue
        sf = find(results, "staleflow", worst)
        if sf is None:
            sf = run(cfg, "staleflow", worst, {}, f"staleflow eta={worst}")
            results.append(sf)
        matched.append({"setting": name, "peer": peer.mode, "peer_eta": peer.eta, "worst": worst,
                        "peer_tok_s": peer.tokens_per_s, "staleflow_tok_s": sf.tokens_per_s, "ratio": ratio(sf, peer)})
    rows = []
    for eta in ETAS:
        sf, best = find(results, "staleflow", eta), best_async(results, eta)
        step, floor = mean_step(sf, cfg.warmup_steps), tail_floor_s(cfg, eta, sf.train_s_mean, sf.fastest_speed)
        rows.append({"setting": name, "model": model, "dist": dist, "split": f"{split[0]}:{split[1]}", "eta": eta,
                     "staleflow": sf.tokens_per_s, "best_async": best.mode, "best_async_tok_s": best.tokens_per_s,
                     "vs_best_async": ratio(sf, best), "vs_sync": ratio(sf, find(results, "verl-sync")),
                     **{f"vs_{m}": ratio(sf, find(results, m, eta)) for m in ASYNC_BASELINES},
                     "over_eta": {m: find(results, m, eta).over_eta for m in ASYNC_BASELINES
                                  if find(results, m, eta) is not None},
                     "step_s": step, "floor_s": floor,
                     # no schedule within the bound beats best async by more than this (same batches):
                     "bound_vs_best_async": round(sf.tokens_per_s / best.tokens_per_s * step / floor, 3),
                     "capped_batches": sum(n >= cfg.max_response for n in sf.longest[cfg.warmup_steps:])
                     / max(1, len(sf.longest[cfg.warmup_steps:])),
                     "matched": [x for x in matched if x["peer_eta"] == eta]})
    return rows, results, f"== {name} (x base = over verl-sync) ==\n{table(results, find(results, 'verl-sync'))}"


def run_ablation(base: SimConfig) -> tuple[dict, list[SimResult]]:
    """Ablated / full staleflow tokens/s at the centre, each the ratio of the means over ABLATION_SEEDS."""
    model, eta, dist, split = CENTRE
    _, cost_model, tp = next(m for m in MODELS if m[0] == model)
    cfg = setting_cfg(base, cost_model, tp, dist, split)
    full = [run(dataclasses.replace(cfg, seed=s), "staleflow", eta, {}, f"staleflow eta={eta} seed={s}")
            for s in ABLATION_SEEDS]
    every = list(full)
    mean_full = sum(r.tokens_per_s for r in full) / len(full)
    out = {}
    for label, mode, ov in ABLATIONS:
        rs = [run(dataclasses.replace(cfg, seed=s), mode, eta, ov, f"staleflow eta={eta} {label} seed={s}")
              for s in ABLATION_SEEDS]
        every += rs
        out[label] = round(sum(r.tokens_per_s for r in rs) / len(rs) / mean_full, 3)
    return out, every


def run_grid(base: SimConfig, jobs: int = 1, progress=print) -> tuple[list[dict], list[SimResult], dict]:
    """(per-setting rows, every result, ablation ratios at the centre), settings in `jobs` processes."""
    from concurrent.futures import ProcessPoolExecutor

    tasks = [(model, cost_model, tp, dist, split) for model, cost_model, tp in MODELS for dist in DISTS
             for split in SPLITS]
    rows, every = [], []
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        abl = pool.submit(run_ablation, base)
        futures = [pool.submit(run_setting, base, *t) for t in tasks]
        for f in futures:  # in grid order, as they finish
            r, results, tab = f.result()
            rows += r
            every += results
            progress(tab + "\n")
        ablation, runs = abl.result()
        every += runs
    return rows, every, ablation


def summary(rows: list[dict], every: list[SimResult], ablation: dict) -> dict:
    vs_sync = [r["vs_sync"] for r in rows]
    vs_best = [r["vs_best_async"] for r in rows]
    best = Counter(r["best_async"] for r in rows).most_common(1)[0][0]
    return {"vs_sync_max": max(vs_sync), "vs_sync_avg": round(sum(vs_sync) / len(vs_sync), 3),
            "vs_best_async_max": max(vs_best), "vs_best_async_avg": round(sum(vs_best) / len(vs_best), 3),
            "best_async": best, "ablation": ablation,
            "violations": sum(len(r.violations) for r in every)}


def summary_table(rows: list[dict]) -> str:
    head = (f"{'setting':26s} {'eta':>3s} {'staleflow':>10s} {'best async':>18s} {'tok/s':>8s} {'x best':>7s} "
            f"{'x sync':>7s} {'step s':>7s} {'floor s':>7s} {'bound':>6s}  groups over eta (fully-async / areal)")
    lines = [head, "-" * len(head)]
    for r in rows:
        oe = r["over_eta"]
        lines.append(f"{r['setting']:26s} {r['eta']:3d} {r['staleflow']:10.0f} {r['best_async']:>18s} "
                     f"{r['best_async_tok_s']:8.0f} {r['vs_best_async']:7.3f} {r['vs_sync']:7.3f} {r['step_s']:7.1f} "
                     f"{r['floor_s']:7.1f} {r['bound_vs_best_async']:6.3f}  "
                     f"{oe.get('verl-fully-async', 0)} / {oe.get('areal', 0)}")
    return "\n".join(lines)


def bound_stats(rows: list[dict]) -> dict:
    """What the tail floor allows: staleflow / best async if staleflow stepped AT its floor (any schedule
    that keeps every trajectory within eta, trains the same batches and changes no data)."""
    b = [r["bound_vs_best_async"] for r in rows]
    capped = [r["capped_batches"] for r in rows]
    return {"bound_vs_best_async_avg": round(sum(b) / len(b), 3), "bound_vs_best_async_max": max(b),
            "capped_batches_min": round(min(capped), 3)}


def matched_table(rows: list[dict]) -> tuple[str, dict]:
    """Staleflow bounded at each peer's observed worst staleness, against that peer (and the summary)."""
    ms = [m for r in rows for m in r["matched"]]
    head = f"{'setting':26s} {'peer':>17s} {'peer eta':>8s} {'worst':>5s} {'peer tok/s':>10s} {'staleflow':>9s} {'ratio':>6s}"
    lines = [head, "-" * len(head)]
    for m in ms:
        lines.append(f"{m['setting']:26s} {m['peer']:>17s} {m['peer_eta']:8d} {m['worst']:5d} {m['peer_tok_s']:10.0f} "
                     f"{m['staleflow_tok_s']:9.0f} {m['ratio']:6.3f}")
    rs = [m["ratio"] for m in ms]
    stats = {"avg": round(sum(rs) / len(rs), 3), "max": max(rs), "min": min(rs), "n": len(rs)} if rs else {}
    return "\n".join(lines), stats


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
    labels = [f"{r['setting']} eta={r['eta']}" for r in rows]
    for ax, key, title in ((axes[0], "vs_sync", "staleflow / verl-sync"),
                           (axes[1], "vs_best_async", "staleflow / best async baseline (same eta)")):
        vals = [r[key] for r in rows]
        ax.barh(labels[::-1], vals[::-1], color=["tab:blue" if v >= 1 else "tab:red" for v in vals][::-1])
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(title)
        ax.set_xlabel("trained tokens/s ratio")
    fig.suptitle("staleflow sim --grid paper (128 H20-class GPUs)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(base: SimConfig) -> int:
    t0 = time.perf_counter()
    print(f"staleflow sim --grid paper: {len(MODELS) * len(DISTS) * len(SPLITS) * len(ETAS)} settings "
          f"(models {[m for m, _, _ in MODELS]}, eta {list(ETAS)}, lengths {list(DISTS)}, splits "
          f"{[f'{a}:{b}' for a, b in SPLITS]}), modes {list(MODES)}, ablations at {CENTRE}; {base.steps} steps per "
          f"run, first {base.warmup_steps} not measured, B={base.batch_size} x N={base.group_size}, seed {base.seed}; "
          f"{base.jobs or os.cpu_count()} processes", flush=True)

    def progress(text):
        print(f"\n{text}({time.perf_counter() - t0:.0f} s)", flush=True)

    jobs = base.jobs or os.cpu_count() or 1
    rows, every, ablation = run_grid(base, jobs, progress)
    print("\nSummary: staleflow at each setting and eta vs verl-sync and the best asynchronous baseline at that eta")
    print(summary_table(rows))
    tab, matched = matched_table(rows)
    print("\nMatched worst case: staleflow with eta = the peer's observed worst staleness (the peer's own eta bounds"
          f" admission only)\n{tab}\nmatched worst case, staleflow / peer: {matched}")
    bound = bound_stats(rows)
    print("\nTail floor: no schedule that keeps every trajectory within eta (same batches, no data dropped or "
          "truncated) steps faster than floor s, so staleflow / best async can reach at most "
          f"{bound['bound_vs_best_async_avg']} on average and {bound['bound_vs_best_async_max']} at most "
          f"(the 'bound' column; a response at the cap was in >= {bound['capped_batches_min']:.0%} of the "
          f"measured batches of every setting): {bound}")
    print(f"\nAblation at the grid centre {CENTRE} (ablated / full staleflow tokens/s, means over seeds "
          f"{list(ABLATION_SEEDS)}): " + ", ".join(f"{k} {v}" for k, v in ablation.items()))
    out = summary(rows, every, ablation)
    out_dir = base.out_dir or "runs/sim-grid"
    plot(rows, os.path.join(out_dir, "grid.png"))
    with open(os.path.join(out_dir, "grid.json"), "w") as f:
        json.dump({"summary": out, "matched_worst_case": matched, "tail_floor": bound, "settings": rows,
                   "runs": [r.row() for r in every]},
                  f, indent=1, default=str)
    print(f"\nwrote {os.path.join(out_dir, 'grid.png')} and {os.path.join(out_dir, 'grid.json')}; "
          f"{len(every)} runs in {time.perf_counter() - t0:.0f} s")
    for r in every:
        if r.violations:
            print(f"PROTOCOL VIOLATION or incomplete run in {r.label}: {r.violations[:3]}", file=sys.stderr)
    print(json.dumps(out))
    return 1 if out["violations"] else 0
