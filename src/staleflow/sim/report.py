"""Run the comparison (every mode on one workload and seed), the ablation, and report them.

``compare(cfg)`` runs sync (eta 0), one-step-off (eta 1), and areal / staleflow at every eta of
the config, then (optionally) staleflow at the largest eta with each strategy switched off in
turn. ``table`` formats the rows, ``plot`` writes a PNG (matplotlib, Agg), ``ratios`` gives the
final JSON line: staleflow tokens/s over each baseline (areal at the same eta; the top-level
keys use the largest eta, ``by_eta`` has every eta).
"""

from __future__ import annotations

import json
import os

from staleflow.sim.config import SimConfig
from staleflow.sim.simulator import SimResult, run

ABLATIONS: list[tuple[str, dict]] = [
    ("-waterfall (least-loaded)", {"routing": "least-loaded"}),
    ("-mlq (fifo)", {"mlq": False}),
    ("-status pull (greedy)", {"pull": "greedy"}),
    ("-migration", {"migration": False}),
    ("-partial rollout", {"interrupt_on_pull": False}),
]


def compare(cfg: SimConfig, progress=None) -> tuple[list[SimResult], list[SimResult]]:
    plan: list[tuple[str, int, dict, str]] = []
    for mode in cfg.modes:
        if mode == "sync":
            plan.append((mode, 0, {}, "sync"))
        elif mode == "one-step-off":
            plan.append((mode, 1, {}, "one-step-off"))
        else:
            plan += [(mode, e, {}, f"{mode} eta={e}") for e in cfg.eta]
    results = []
    for mode, eta, ov, label in plan:
        results.append(run(cfg, mode, eta, ov, label))
        if progress:
            progress(results[-1])
    ablation = []
    if cfg.ablation and "staleflow" in cfg.modes:
        e = max(cfg.eta)
        for name, ov in ABLATIONS:
            ablation.append(run(cfg, "staleflow", e, ov, f"staleflow eta={e} {name}"))
            if progress:
                progress(ablation[-1])
    return results, ablation


def _find(results: list[SimResult], mode: str, eta: int | None = None) -> SimResult | None:
    for r in results:
        if r.mode == mode and (eta is None or r.eta == eta):
            return r
    return None


def _ratio(a: SimResult | None, b: SimResult | None) -> float | None:
    if a is None or b is None or b.tokens_per_s <= 0:
        return None
    return round(a.tokens_per_s / b.tokens_per_s, 3)


def ratios(results: list[SimResult], cfg: SimConfig) -> dict:
    by_eta = {}
    for e in cfg.eta:
        sf = _find(results, "staleflow", e)
        by_eta[str(e)] = {"vs_sync": _ratio(sf, _find(results, "sync")),
                          "vs_one_step_off": _ratio(sf, _find(results, "one-step-off")),
                          "vs_areal": _ratio(sf, _find(results, "areal", e))}
    top = by_eta[str(max(cfg.eta))]
    return {**top, "eta": max(cfg.eta), "by_eta": by_eta}


def table(results: list[SimResult], base: SimResult | None = None) -> str:
    head = (f"{'run':44s} {'tok/s':>9s} {'samp/s':>7s} {'x base':>7s} {'util':>5s} {'step s':>7s} "
            f"{'pulls':>6s} {'intr':>6s} {'migr':>5s} {'abort':>6s} {'tr idle':>7s}  staleness hist")
    lines = [head, "-" * len(head)]
    for r in results:
        util = sum(r.utilisation) / max(1, len(r.utilisation))
        steps = r.step_times[1:] or r.step_times
        step = sum(steps) / max(1, len(steps))
        x = f"{r.tokens_per_s / base.tokens_per_s:.2f}" if base and base.tokens_per_s > 0 else "-"
        hist = " ".join(f"{k}:{v}" for k, v in r.staleness_hist.items())
        flag = "  !" + "; ".join(r.violations[:2]) if r.violations else ""
        lines.append(f"{r.label:44s} {r.tokens_per_s:9.0f} {r.samples_per_s:7.2f} {x:>7s} {util:5.2f} {step:7.1f} "
                     f"{r.pulls:6d} {r.interrupts:6d} {r.migrations:5d} {sum(r.aborts.values()):6d} "
                     f"{r.trainer_idle_frac:7.2f}  {hist}{flag}")
    return "\n".join(lines)


def plot(results: list[SimResult], ablation: list[SimResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results + ablation
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    ax1.barh([r.label for r in runs][::-1], [r.tokens_per_s for r in runs][::-1],
             color=["tab:gray" if r in ablation else "tab:blue" if r.mode == "staleflow" else "tab:orange"
                    for r in runs][::-1])
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
        json.dump({"summary": summary, "runs": [r.row() for r in results], "ablation": [r.row() for r in ablation]},
                  f, indent=1, default=str)
