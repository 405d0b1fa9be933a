"""The PNG report of a run folder: reward and held-out accuracy (with its 95% interval),
throughput, staleness histogram, per-rank timeline, each instance's pull time, the traffic
between nodes (multi-node runs), and with an environment (--env.name) the turns, tool calls and
tool seconds per trajectory.

    python -m staleflow.metrics.report RUN_DIR      (written at the end of every run as RUN_DIR/report.png)
"""

from __future__ import annotations

import os
import sys
from collections import Counter

from staleflow.metrics.writer import read_jsonl

_COLORS = {
    "generate": "tab:blue",
    "train": "tab:orange",
    "pull": "tab:green",
    "push": "tab:red",
    "idle": "lightgray",
    "read": "tab:purple",
    "checkpoint": "tab:brown",
}


def make_report(run_dir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if not r.get("superseded")]
    steps = [r for r in rows if "eval_n" not in r]
    evals = [r for r in rows if "eval_n" in r]
    spans = read_jsonl(os.path.join(run_dir, "timeline.jsonl"))
    if not steps:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no steps: nothing to report (did the run train?)")
    turns = any("turns_mean" in s for s in steps)
    fig, axes = plt.subplots(4 if turns else 3, 2, figsize=(13, 16.5 if turns else 12.5))
    x = [s["step"] for s in steps]

    ax = axes[0][0]
    ax.plot(x, [s.get("reward_mean", 0.0) for s in steps], "o-", label="mean reward")
    if any("accuracy" in s for s in steps):
        ax.plot(x, [s.get("accuracy", 0.0) for s in steps], "s--", label="accuracy (training samples)")
    if evals:
        _held_out(ax, evals)
    ax.set_xlabel("step (weight version)")
    ax.set_title("Reward and accuracy")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[0][1]
    ax.plot(x, [s.get("tokens_per_s", 0.0) for s in steps], "o-", label="generated tokens/s")
    ax.plot(x, [s.get("samples_per_s", 0.0) * 100 for s in steps], "s--", label="samples/s x100")
    ax.set_xlabel("step")
    ax.set_title("Throughput (since previous step)")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[1][0]
    hist: Counter = Counter()
    for s in steps:
        for k, n in (s.get("staleness_hist") or {}).items():
            hist[int(k)] += n
    if hist:
        keys = sorted(hist)
        ax.bar(keys, [hist[k] for k in keys], color="tab:purple")
        ax.set_xticks(keys)
    ax.set_xlabel("V_buf - V_traj (trained groups)")
    ax.set_title("Staleness histogram")
    ax.grid(alpha=0.3, axis="y")

    ax = axes[1][1]
    seen = set()
    for sp in spans:
        kind = sp.get("kind", "?")
        label = kind if kind not in seen else None
        seen.add(kind)
        ax.barh(
            sp["rank"], sp["t1"] - sp["t0"], left=sp["t0"], color=_COLORS.get(kind, "gray"), label=label, height=0.6
        )
    ranks = sorted({sp["rank"] for sp in spans})
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds since start")
    ax.set_title("Per-rank timeline")
    if seen:
        ax.legend(loc="upper right", fontsize=8)

    _pull_panels(axes[2], steps, x)
    if turns:
        _turn_panels(axes[3], steps)
    fig.suptitle(f"StaleFlow run {os.path.basename(os.path.abspath(run_dir))}")
    fig.tight_layout()
    out = out or os.path.join(run_dir, "report.png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _held_out(ax, evals: list[dict]) -> None:
    """Held-out accuracy with its 95% Wilson interval as error bars (rows before the interval was
    logged have none)."""
    xs, ys = [e["step"] for e in evals], [e["eval_accuracy"] for e in evals]
    label = f"held-out accuracy ({evals[-1]['eval_n']} prompts, greedy)"
    if all("eval_ci95_low" in e for e in evals):
        err = [
            [y - e["eval_ci95_low"] for y, e in zip(ys, evals)],
            [e["eval_ci95_high"] - y for y, e in zip(ys, evals)],
        ]
        ax.errorbar(xs, ys, yerr=err, fmt="D-", color="black", capsize=4, label=label + ", 95% CI")
    else:
        ax.plot(xs, ys, "D-", color="black", label=label)


def _turn_panels(row, steps: list[dict]) -> None:
    """Multi-turn runs: turns and tool calls per finished trajectory, and its tool seconds, per step."""
    pts = [s for s in steps if "turns_mean" in s]
    x = [s["step"] for s in pts]
    ax = row[0]
    ax.plot(x, [s["turns_mean"] for s in pts], "o-", label="turns per trajectory")
    ax.plot(x, [s["tool_calls_per_traj"] for s in pts], "s--", label="tool calls per trajectory")
    ax.set_xlabel("step")
    ax.set_title("Turns and tool calls (trajectories finished since the previous step)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = row[1]
    ax.plot(x, [s["tool_s_per_traj"] * 1000 for s in pts], "o-", color="tab:green", label="tool time per trajectory")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("Tool (environment step) time per trajectory")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _pull_panels(row, steps: list[dict], x: list[int]) -> None:
    """Mean pull time of each instance per step; weights and records that crossed nodes (run totals)."""
    ax = row[0]
    instances = sorted({i for s in steps for i in (s.get("pull_s_by_instance") or {})}, key=int)
    for i in instances:
        pts = [
            (s["step"], s["pull_s_by_instance"][i] * 1000) for s in steps if i in (s.get("pull_s_by_instance") or {})
        ]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"instance {i}")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("Weight pull time per instance (mean over the step)")
    if instances:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax = row[1]
    pull_mb = [s.get("cross_node_pull_bytes", 0) / 1e6 for s in steps]
    rec_mb = [s.get("cross_node_record_bytes", 0) / 1e6 for s in steps]
    if any(pull_mb) or any(rec_mb):
        ax.plot(x, pull_mb, "o-", label="weights pulled from another node")
        ax.set_ylabel("weights, MB")
        right = ax.twinx()  # records are a thousandth of the weights' bytes: their own scale
        right.plot(x, rec_mb, "s--", color="tab:orange", label="records shipped or fetched")
        right.set_ylabel("records, MB")
        recs = steps[-1].get("cross_node_records", 0)
        ax.set_title(f"Cross-node traffic (run totals; {recs} records)")
        ax.legend(loc="upper left", fontsize=8)
        right.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "single node: nothing crossed the network", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("Cross-node traffic")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m staleflow.metrics.report RUN_DIR", file=sys.stderr)
        sys.exit(2)
    print(make_report(sys.argv[1]))
