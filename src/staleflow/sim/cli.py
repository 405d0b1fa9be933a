"""``python -m staleflow sim [--preset paper-32b|cpu-small] [--grid paper] [--flags]``: the discrete-event comparison.

One setting: prints the configuration, one table row per run (verl-sync, verl-one-step-off,
verl-fully-async, areal and staleflow at each eta), the ablation table (staleflow with each part
removed), writes a PNG plot and results.json under --out-dir, and ends with one JSON line
{"vs_sync", "vs_best_async", "best_async", "vs_<baseline>", "eta", "by_eta", "violations"} (staleflow
over each baseline at the same eta). ``--grid paper`` runs the evaluation grid instead (sim/grid.py).
Exit status 1 if any run broke the protocol audit (staleness bound, lost or double-consumed data).
"""

from __future__ import annotations

import json
import os
import sys
import time

from staleflow.config import ConfigError
from staleflow.config.parse import parse
from staleflow.coordinator.cost_model import CostModelError, load_cost_model
from staleflow.sim.config import PRESETS, SimConfig
from staleflow.sim.report import compare, find, plot, ratios, table, write_json


def main(argv: list[str]) -> int:
    cfg = parse(SimConfig, argv, PRESETS, default="paper-32b", prog="staleflow sim")
    try:
        cost = load_cost_model(cfg.cost_model)
    except CostModelError as e:
        raise ConfigError(f"--cost-model: {e}") from None
    if cfg.grid:
        from staleflow.sim.grid import main as grid_main

        return grid_main(cfg)
    t0 = time.perf_counter()
    n_dis = cfg.rollout_gpus // cfg.gpus_per_instance
    dist = (
        f"lognormal(median {cfg.response_median:.0f}, sigma {cfg.response_sigma})"
        if cfg.length_dist == "lognormal"
        else cfg.length_dist
    )
    print(
        f"staleflow sim: {cfg.total_gpus} GPUs (disaggregated: {cfg.rollout_gpus} rollout = {n_dis} instances x "
        f"TP{cfg.gpus_per_instance}, {cfg.total_gpus - cfg.rollout_gpus} train; verl-sync: all colocated), "
        f"cost model {cost.name} (router: fitted to {cfg.router_fit_samples} noisy samples), "
        f"B={cfg.staleness.batch_size} groups x N={cfg.staleness.group_size}, responses {dist} <= {cfg.max_response}, "
        f"{cfg.steps} steps (first {cfg.warmup_steps} not measured), seed {cfg.seed}",
        flush=True,
    )

    def progress(r):
        print(f"  ran {r.label:46s} {r.tokens_per_s:9.0f} tok/s  ({time.perf_counter() - t0:5.1f} s)", flush=True)

    results, ablation = compare(cfg, progress)
    base = find(results, "verl-sync") or results[0]
    print("\nComparison (same workload and seed; x base = tokens/s over " + base.label + ")")
    print(table(results, base))
    if ablation:
        sf = find(results, "staleflow", max(cfg.eta))
        print(f"\nAblation (staleflow eta={max(cfg.eta)}, one part removed at a time; x base = over full staleflow)")
        print(table(([sf] if sf else []) + ablation, sf))
    summary = ratios(results, cfg) if "staleflow" in cfg.modes else {}
    bad = [(r.label, r.violations) for r in results + ablation if r.violations]
    summary["violations"] = sum(len(v) for _, v in bad)
    if cfg.out_dir:
        png = os.path.join(cfg.out_dir, "sim.png")
        plot(results, ablation, png, f"{cost.name}, {cfg.total_gpus} GPUs")
        write_json(results, ablation, summary, os.path.join(cfg.out_dir, "results.json"))
        print(f"\nwrote {png} and {os.path.join(cfg.out_dir, 'results.json')}")
    print(f"simulated {len(results) + len(ablation)} runs in {time.perf_counter() - t0:.1f} s")
    for label, v in bad:
        print(f"PROTOCOL VIOLATION or incomplete run in {label}: {v[:3]}", file=sys.stderr)
    print(json.dumps(summary))
    return 1 if bad else 0
