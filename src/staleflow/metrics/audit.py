"""Audit a run folder from its own records: every buffer trained exactly once, no trajectory
trained twice, no id reused, the staleness bound held, rows after a crash marked superseded.

    report = audit_run("runs/x", steps=12, batch_size=4, group_size=4, eta=1)
    report.ok, report.problems

Rows marked ``"superseded": true`` (written after the checkpoint a run resumed from) are not
training that counts; their ids must still never be reused. Used by the fault-injection tests
and scripts/chaos.py; a user can run it on any run folder.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from staleflow.durable import read_jsonl


@dataclass
class Audit:
    steps: int = 0
    buffers: dict[int, int] = field(default_factory=dict)
    """buffer version -> groups trained in it (superseded rows excluded)."""
    superseded_rows: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _rows(path: Path) -> list[dict]:
    return read_jsonl(path)[0]  # a line torn by a crash is not a trained group


def audit_run(run_dir: str | Path, steps: int, batch_size: int, group_size: int, eta: int) -> Audit:
    run = Path(run_dir)
    a = Audit()
    trained = _rows(run / "trained.jsonl")
    metrics = [m for m in _rows(run / "metrics.jsonl") if "eval_n" not in m]  # evaluation rows are not steps
    live = [r for r in trained if not r.get("superseded")]
    a.superseded_rows = len(trained) - len(live) + sum(1 for m in metrics if m.get("superseded"))
    a.buffers = dict(sorted(collections.Counter(r["buffer"] for r in live).items()))
    if sorted(a.buffers) != list(range(steps)):
        a.problems.append(f"trained buffers {sorted(a.buffers)} != 0..{steps - 1}")
    wrong = {b: n for b, n in a.buffers.items() if n != batch_size}
    if wrong:
        a.problems.append(f"buffers with a group count other than {batch_size}: {wrong}")
    seen: dict[int, int] = {}
    for r in live:
        if not r["traj_version"] <= r["buffer"] <= r["traj_version"] + eta:
            a.problems.append(f"group {r['group_id']} V_traj {r['traj_version']} trained in buffer {r['buffer']}")
        if len(r["traj_ids"]) != group_size:
            a.problems.append(f"group {r['group_id']} has {len(r['traj_ids'])} trajectories, not {group_size}")
        for t in r["traj_ids"]:
            if t in seen:
                a.problems.append(f"trajectory {t} trained twice (buffers {seen[t]} and {r['buffer']})")
            seen[t] = r["buffer"]
    live_ids = set(seen)
    old_ids = {t for r in trained if r.get("superseded") for t in r["traj_ids"]}
    old_groups = {r["group_id"] for r in trained if r.get("superseded")}
    if live_ids & old_ids:
        a.problems.append(f"{len(live_ids & old_ids)} trajectory ids of superseded rows were reused")
    if {r["group_id"] for r in live} & old_groups:
        a.problems.append("group ids of superseded rows were reused")
    counted = [m["step"] for m in metrics if not m.get("superseded")]
    a.steps = len(counted)
    if counted != list(range(steps)):
        a.problems.append(f"metrics rows for steps {counted} != 0..{steps - 1}")
    return a
