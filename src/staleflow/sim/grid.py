"""``staleflow sim --grid paper``: the evaluation grid, every mode at matched eta.

Axes (2 x 3 x 2 x 2 = 24 settings): a 7B-class and a 32B-class cost model (PSRL's Qwen2.5-7B TP1
and Qwen2.5-32B TP2 coefficients; KV capacity, prefill/train rates and weight-transfer times derived
from the model size and an H20, sim/hardware.py), eta in {1, 2, 3}, two response-length
distributions (lognormal and long-cot, sim/lengths.py) and two rollout:train splits of 128 GPUs
(64:64 and 96:32, the splits of verl's fully-async example scripts). Every setting runs verl-sync,
verl-one-step-off (their eta is fixed: 0 and 1), verl-fully-async, areal and staleflow (at the
setting's eta); the ablations (report.ABLATIONS) run at the grid centre. Per setting: staleflow over
verl-sync and over the best asynchronous baseline at the same eta (verl-one-step-off only counts
at eta 1). Prints per-setting tables and a summary, saves grid.png and grid.json, and ends with
the JSON line {"vs_sync_max", "vs_sync_avg", "vs_best_async_max", "vs_best_async_avg",
"best_async", "ablation", "violations"} (averages: arithmetic over the 24 settings).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import Counter

from staleflow.coordinator.modes import ASYNC_BASELINES
from staleflow.sim.config import SimConfig
from staleflow.sim.report import ABLATIONS, FIXED_ETA, best_async, find, ratio, table
from staleflow.sim.simulator import SimResult, run

MODELS = (("7B", "qwen2.5-7b-tp1", 1), ("32B", "qwen2.5-32b-tp2", 2))
ETAS = (1, 2, 3)
DISTS = ("lognormal", "long-cot")
SPLITS = ((64, 64), (96, 32))
MODES = ("verl-sync", "verl-one-step-off", "verl-fully-async", "areal", "staleflow")
CENTRE = ("32B", 2, "long-cot", (64, 64))


def setting_cfg(base: SimConfig, cost_model: str, tp: int, dist: str, split: tuple[int, int]) -> SimConfig:
    return dataclasses.replace(base, cost_model=cost_model, gpus_per_instance=tp, length_dist=dist,
                               total_gpus=sum(split), rollout_gpus=split[0], out_dir="")


def run_grid(base: SimConfig, progress=None) -> tuple[list[dict], list[SimResult], dict]:
    """(per-setting rows, every result, ablation ratios at the centre)."""
    rows, every, ablation = [], [], {}
    for model, cost_model, tp in MODELS:
        for dist in DISTS:
            for split in SPLITS:
                cfg = setting_cfg(base, cost_model, tp, dist, split)
                results = []
                for mode in MODES:
                    for eta in ([FIXED_ETA[mode]] if mode in FIXED_ETA else ETAS):
                        results.append(run(cfg, mode, eta, {}, f"{mode} eta={eta}"))
                        if progress:
                            progress(model, dist, split, results[-1])
                every += results
                name = f"{model} {dist} {split[0]}:{split[1]}"
                for eta in ETAS:
                    sf, best = find(results, "staleflow", eta), best_async(results, eta)
                    rows.append({"setting": name, "model": model, "dist": dist, "split": f"{split[0]}:{split[1]}",
                                 "eta": eta, "staleflow": sf.tokens_per_s, "best_async": best.mode,
                                 "best_async_tok_s": best.tokens_per_s, "vs_best_async": ratio(sf, best),
                                 "vs_sync": ratio(sf, find(results, "verl-sync")),
                                 **{f"vs_{m}": ratio(sf, find(results, m, eta)) for m in ASYNC_BASELINES},
                                 "over_eta": {m: find(results, m, eta).over_eta for m in ASYNC_BASELINES
                                              if find(results, m, eta) is not None}})
                if (model, dist, split) == (CENTRE[0], CENTRE[2], CENTRE[3]):
                    full = find(results, "staleflow", CENTRE[1])
                    for label, mode, ov in ABLATIONS:
                        r = run(cfg, mode, CENTRE[1], ov, f"staleflow eta={CENTRE[1]} {label}")
                        every.append(r)
                        ablation[label] = ratio(r, full)
                        if progress:
                            progress(model, dist, split, r)
                if progress:
                    progress(model, dist, split, None, table(results, find(results, "verl-sync")))
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
            f"{'x sync':>7s}  groups over eta (fully-async / areal)")
    lines = [head, "-" * len(head)]
    for r in rows:
        oe = r["over_eta"]
        lines.append(f"{r['setting']:26s} {r['eta']:3d} {r['staleflow']:10.0f} {r['best_async']:>18s} "
                     f"{r['best_async_tok_s']:8.0f} {r['vs_best_async']:7.3f} {r['vs_sync']:7.3f}  "
                     f"{oe.get('verl-fully-async', 0)} / {oe.get('areal', 0)}")
    return "\n".join(lines)


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
          f"run, first {base.warmup_steps} not measured, B={base.batch_size} x N={base.group_size}, seed {base.seed}",
          flush=True)

    def progress(model, dist, split, r, tab=None):
        if tab is not None:
            print(f"\n== {model} {dist} {split[0]}:{split[1]} (x base = over verl-sync) ==\n{tab}\n", flush=True)
        else:
            print(f"  {model} {dist} {split[0]}:{split[1]} {r.label:46s} {r.tokens_per_s:9.0f} tok/s "
                  f"({time.perf_counter() - t0:6.1f} s)", flush=True)

    rows, every, ablation = run_grid(base, progress)
    print("\nSummary: staleflow at each setting and eta vs verl-sync and the best asynchronous baseline at that eta")
    print(summary_table(rows))
    print("\nAblation at the grid centre (ablated / full staleflow tokens/s): "
          + ", ".join(f"{k} {v}" for k, v in ablation.items()))
    out = summary(rows, every, ablation)
    out_dir = base.out_dir or "runs/sim-grid"
    plot(rows, os.path.join(out_dir, "grid.png"))
    with open(os.path.join(out_dir, "grid.json"), "w") as f:
        json.dump({"summary": out, "settings": rows, "runs": [r.row() for r in every]}, f, indent=1, default=str)
    print(f"\nwrote {os.path.join(out_dir, 'grid.png')} and {os.path.join(out_dir, 'grid.json')}; "
          f"{len(every)} runs in {time.perf_counter() - t0:.0f} s")
    for r in every:
        if r.violations:
            print(f"PROTOCOL VIOLATION or incomplete run in {r.label}: {r.violations[:3]}", file=sys.stderr)
    print(json.dumps(out))
    return 1 if out["violations"] else 0
