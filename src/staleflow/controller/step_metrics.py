"""The numbers of one trained step, as every front end reports them (the runtime's metrics.jsonl,
the simulator's tables), from the loop's step record and its counters."""

from __future__ import annotations

from collections import Counter

from staleflow.controller.audit import Audit
from staleflow.controller.types import StepRecord

PROTOCOL_TOTALS = {"occupy_exchanges": "exchanges", "order_swaps": "order_swaps"}
"""Running totals of StaleFlow's protocol reported per step (metrics key -> StalenessManager attribute):
reservations moved by the occupy exchange, and occupied groups exchanged by --staleness.train-order drawn
(the two ways it trains out of completion order)."""


def step_metrics(
    rec: StepRecord,
    lens: list[int],
    audit: Audit,
    counts: Counter,
    reward_errors: int,
    turns: list | None = None,
    protocol=None,
) -> dict:
    """response_len_mean: the trained responses' mean length (a step may train responses finished before
    the previous step); lens: the response lengths finished since the previous step (finished_len_mean);
    turns: (turns, tool calls, tool seconds) of the multi-turn trajectories finished since then (their
    keys appear only in a run with an environment, --env.name); protocol: the batch protocol, whose running totals (PROTOCOL_TOTALS:
    StaleFlow's StalenessManager's; the peers' count-based protocols have none) join the row."""
    rewards, stale = rec.rewards, rec.staleness
    hist = Counter(stale)
    c = counts
    row = {
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "accuracy": sum(r > 0.5 for r in rewards) / max(len(rewards), 1),
        "response_len_mean": rec.response_tokens / max(len(rewards), 1),  # of the responses trained
        "finished_len_mean": sum(lens) / max(len(lens), 1),  # of those finished since the previous step
        "staleness_mean": sum(stale) / max(len(stale), 1),
        "staleness_max": max(stale, default=0),
        "staleness_hist": {str(k): n for k, n in sorted(hist.items())},
        "bound_violations": audit.bound_violations,
        "over_eta": audit.over_eta,
        "trained_groups": len(rec.groups),
        "trained_trajectories": len(rewards),
        "trained_tokens": rec.response_tokens,
        "pulls": c["pulls"],
        "interrupts": c["interrupts"],
        "migrations": c["migrations"],
        "routes": c["routes"],
        "groups_aborted": c["groups_aborted"],
        "reward_errors": reward_errors,
        **{k: getattr(protocol, a) for k, a in PROTOCOL_TOTALS.items() if hasattr(protocol, a)},
    }
    if turns:
        n = len(turns)
        row["turns_mean"] = sum(t.turns for t in turns) / n
        row["tool_calls_per_traj"] = sum(t.tool_calls for t in turns) / n
        row["tool_s_per_traj"] = sum(t.tool_s for t in turns) / n
        row["tool_s_total"] = sum(t.tool_s for t in turns)
    return row
