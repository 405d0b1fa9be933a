"""One setting: every mode on one workload and seed, the ablation, and how to print and save them.

``compare(cfg)`` runs verl-sync (eta 0), verl-one-step-off (eta 1), and the streaming modes
(verl-fully-async, areal, staleflow, ...) at every eta of the config, then (optionally) staleflow at
the largest eta with each part removed in turn (``ABLATIONS``). ``ratios`` gives the final JSON
line: staleflow tokens/s over each baseline AT THE SAME ETA (verl-one-step-off only counts as an
asynchronous baseline at eta 1, its only bound), and over the best asynchronous one.
"""

from __future__ import annotations

import dataclasses
import json
import os

from staleflow.modes import async_peers, check_mode, mode_of
from staleflow.sim.config import SimConfig
from staleflow.sim.simulator import SimResult, run

ABLATIONS: list[tuple[str, str, dict, dict]] = [
    ("-occupy exchange", "staleflow-no-exchange", {}, {}),
    ("-mlq (fifo)", "staleflow", {"mlq": False}, {}),
    ("-waterfall (least-loaded)", "staleflow", {"routing": "least-loaded"}, {}),
    ("+status pull (off by default: greedy)", "staleflow", {"pull": "status"}, {}),
    ("-migration (resume on origin)", "staleflow", {"migration": False}, {}),
    ("-partial rollout (drain)", "staleflow", {"interrupt_on_pull": False}, {}),
    ("-keep kv (re-prefill after a pull)", "staleflow", {"keep_kv_on_pull": False}, {}),
    ("-kv move (re-prefill a migrated trajectory)", "staleflow", {}, {"kv_move_gb_s": 0.0}),
    ("+tail lanes (off by default)", "staleflow", {"tail_lanes": True}, {}),
    ("-speculative decoding (one token per step)", "staleflow", {}, {"spec_accept": 1.0}),
]
"""Full StaleFlow with exactly one part removed, or (+) one part that is off by default added, because it read > 1.0
here at the paper-like centre (name, mode, coordinator overrides, SimConfig changes)."""


def plan(modes, etas) -> list[tuple[str, int, str]]:
    """(mode, eta, label) of every run of one setting (a fixed-eta peer once, at its eta)."""
    out = []
    for mode in (check_mode(m) for m in modes):
        if mode_of(mode).fixed_eta >= 0:
            out.append((mode, mode_of(mode).fixed_eta, mode))
        else:
            out += [(mode, e, f"{mode} eta={e}") for e in etas]
    return out


def compare(cfg: SimConfig, progress=None) -> tuple[list[SimResult], list[SimResult]]:
    results = []
    for mode, eta, label in plan(cfg.modes, cfg.eta):
        results.append(run(cfg, mode, eta, {}, label))
        if progress:
            progress(results[-1])
    ablation = []
    if cfg.ablation and "staleflow" in cfg.modes:
        e = max(cfg.eta)
        for name, mode, ov, changes in ABLATIONS:
            ablation.append(run(dataclasses.replace(cfg, **changes), mode, e, ov, f"staleflow eta={e} {name}"))
            if progress:
                progress(ablation[-1])
    return results, ablation


def find(results: list[SimResult], mode: str, eta: int | None = None) -> SimResult | None:
    for r in results:
        if r.mode == mode and (eta is None or r.eta == eta):
            return r
    return None


def ratio(a: SimResult | None, b: SimResult | None) -> float | None:
    if a is None or b is None or b.tokens_per_s <= 0:
        return None
    return round(a.tokens_per_s / b.tokens_per_s, 3)


def best_async(results: list[SimResult], eta: int) -> SimResult | None:
    """The fastest asynchronous baseline (a registered peer or a fork's) whose staleness setting is `eta`."""
    cands = [r for r in results if mode_of(r.mode).peer and mode_of(r.mode).fixed_eta != 0 and r.eta == eta]
    return max(cands, key=lambda r: r.tokens_per_s, default=None)


def ratios(results: list[SimResult], cfg: SimConfig) -> dict:
    by_eta = {}
    for e in cfg.eta:
        sf = find(results, "staleflow", e)
        best = best_async(results, e)
        row = {
            "vs_sync": ratio(sf, find(results, "verl-sync")),
            "vs_best_async": ratio(sf, best),
            "best_async": best.mode if best else None,
        }
        for m in async_peers():
            row[f"vs_{m.replace('-', '_')}"] = ratio(sf, find(results, m, e))
        by_eta[str(e)] = row
    top = by_eta[str(max(cfg.eta))]
    return {**top, "eta": max(cfg.eta), "by_eta": by_eta}


def table(results: list[SimResult], base: SimResult | None = None) -> str:
    head = (
        f"{'run':46s} {'tok/s':>9s} {'samp/s':>7s} {'x base':>7s} {'util':>5s} {'step s':>7s} "
        f"{'pulls':>6s} {'intr':>6s} {'migr':>5s} {'abort':>6s} {'>eta':>5s} {'tr idle':>7s}  staleness hist"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        util = sum(r.utilisation) / max(1, len(r.utilisation))
        steps = r.step_times[1:] or r.step_times
        step = sum(steps) / max(1, len(steps))
        x = f"{r.tokens_per_s / base.tokens_per_s:.2f}" if base and base.tokens_per_s > 0 else "-"
        hist = " ".join(f"{k}:{v}" for k, v in r.staleness_hist.items())
        flag = "  !" + "; ".join(r.violations[:2]) if r.violations else ""
        lines.append(
            f"{r.label:46s} {r.tokens_per_s:9.0f} {r.samples_per_s:7.2f} {x:>7s} {util:5.2f} {step:7.1f} "
            f"{r.pulls:6d} {r.interrupts:6d} {r.migrations:5d} {sum(r.aborts.values()):6d} {r.over_eta:5d} "
            f"{r.trainer_idle_frac:7.2f}  {hist}{flag}"
        )
    return "\n".join(lines)


def colour(r: SimResult, ablation: list[SimResult]) -> str:
    if r in ablation:
        return "tab:gray"
    return "tab:blue" if mode_of(r.mode).peer == "" else "tab:orange"


def plot(results: list[SimResult], ablation: list[SimResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results + ablation
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    ax1.barh(
        [r.label for r in runs][::-1],
        [r.tokens_per_s for r in runs][::-1],
        color=[colour(r, ablation) for r in runs][::-1],
    )
    ax1.set_xlabel("trained tokens / s (steady state)")
    ax1.set_title(title)
    for r in results:
        ks = sorted(r.staleness_hist)
        tot = sum(r.staleness_hist.values()) or 1
        ax2.plot(ks, [r.staleness_hist[k] / tot for k in ks], marker="o", label=r.label)
    ax2.set_xlabel("staleness V_buf - V_traj")
    ax2.set_ylabel("fraction of consumed groups")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(results: list[SimResult], ablation: list[SimResult], summary: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"summary": summary, "runs": [r.row() for r in results], "ablation": [r.row() for r in ablation]},
            f,
            indent=1,
            default=str,
        )
