"""Audit a run folder from its own records: every buffer trained exactly once, no trajectory or
prompt group trained twice (by id and by content), no id reused, the staleness bound held, rows
after a crash marked superseded.

    report = audit_run("runs/x", steps=12, batch_size=4, group_size=4, eta=1)
    report.ok, report.problems, report.lost, report.duplicated

Rows marked ``"superseded": true`` (written after the checkpoint a run resumed from) are not
training that counts; their ids must still never be reused. Every trained.jsonl row carries
``content``: one ``content_digest`` per member, computed by the trainer from the prompt and
response tokens it actually read and trained on, so a group trained twice is found by what was
trained, whatever its ids say. Used by the fault-injection tests and scripts/chaos.py; a user
can run it on any run folder.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from staleflow.durable import read_jsonl


def content_digest(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> str:
    """A short digest of one trained trajectory's tokens (the prompt's length is hashed too, so
    moving a token between prompt and response changes it).

    >>> content_digest([1, 2], [3]) == content_digest([1], [2, 3])
    False
    """
    h = hashlib.sha256(struct.pack("<QQ", len(prompt_ids), len(response_ids)))
    h.update(array("q", prompt_ids).tobytes())
    h.update(array("q", response_ids).tobytes())
    return h.hexdigest()[:20]


def version_counts(versions: Sequence[int]) -> list[list[int]]:
    """One trained response's tokens per weight version that sampled them, [[version, tokens], ...]
    in order (trained.jsonl's ``token_versions``: more than one entry after a pull that kept the KV).

    >>> version_counts([4, 4, 4, 5, 5])
    [[4, 3], [5, 2]]
    """
    out: list[list[int]] = []
    for v in versions:
        if out and out[-1][0] == int(v):
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


@dataclass
class Audit:
    steps: int = 0
    buffers: dict[int, int] = field(default_factory=dict)
    """buffer version -> groups trained in it (superseded rows excluded)."""
    superseded_rows: int = 0
    lost: list[str] = field(default_factory=list)
    """A buffer, a step or a group member missing, or training without a record of its content."""
    duplicated: list[str] = field(default_factory=list)
    """Something trained twice (by id or by content), or an id of superseded training reused."""
    other: list[str] = field(default_factory=list)
    """Anything else: the staleness bound broken."""

    @property
    def problems(self) -> list[str]:
        return self.lost + self.duplicated + self.other

    @property
    def ok(self) -> bool:
        return not self.problems


def _rows(path: Path) -> list[dict]:
    return read_jsonl(path)[0]  # a line torn by a crash is not a trained group


def audit_run(
    run_dir: str | Path, steps: int, batch_size: int, group_size: int, eta: int, require_content: bool = False
) -> Audit:
    """``steps``: the buffers 0..steps-1 must each be trained once; ``require_content``: a live row
    without its content digests is a problem (else only when some rows have them)."""
    run = Path(run_dir)
    trained = _rows(run / "trained.jsonl")
    metrics = [m for m in _rows(run / "metrics.jsonl") if "eval_n" not in m]  # evaluation rows are not steps
    return audit_rows(trained, metrics, steps, batch_size, group_size, eta, require_content)


def audit_rows(
    trained: list[dict],
    metrics: list[dict],
    steps: int,
    batch_size: int,
    group_size: int,
    eta: int,
    require_content: bool = False,
) -> Audit:
    """The audit of a run's trained.jsonl and metrics.jsonl rows (see audit_run)."""
    a = Audit()
    live = [r for r in trained if not r.get("superseded")]
    a.superseded_rows = len(trained) - len(live) + sum(1 for m in metrics if m.get("superseded"))
    a.buffers = dict(sorted(collections.Counter(r["buffer"] for r in live).items()))
    if sorted(a.buffers) != list(range(steps)):
        missing = sorted(set(range(steps)) - set(a.buffers))
        if missing:
            a.lost.append(f"buffers {missing} were never trained")
        extra = sorted(set(a.buffers) - set(range(steps)))
        if extra:
            a.other.append(f"buffers {extra} beyond 0..{steps - 1} were trained")
    for b, n in a.buffers.items():
        if n < batch_size:
            a.lost.append(f"buffer {b} trained {n} groups, not {batch_size}")
        elif n > batch_size:
            a.duplicated.append(f"buffer {b} trained {n} groups, not {batch_size} (trained twice?)")
    _check_rows(a, live, group_size, eta, require_content or any("content" in r for r in trained))
    old_ids = {t for r in trained if r.get("superseded") for t in r["traj_ids"]}
    old_groups = {r["group_id"] for r in trained if r.get("superseded")}
    reused = {t for r in live for t in r["traj_ids"]} & old_ids
    if reused:
        a.duplicated.append(f"{len(reused)} trajectory ids of superseded rows were reused")
    if {r["group_id"] for r in live} & old_groups:
        a.duplicated.append("group ids of superseded rows were reused")
    counted = [m["step"] for m in metrics if not m.get("superseded")]
    a.steps = len(counted)
    twice = sorted(s for s, n in collections.Counter(counted).items() if n > 1)
    if twice:
        a.duplicated.append(f"metrics rows for steps {twice} written twice")
    if sorted(set(counted)) != list(range(steps)):
        a.lost.append(f"metrics rows for steps {sorted(set(counted))} != 0..{steps - 1}")
    return a


def _check_rows(a: Audit, live: list[dict], group_size: int, eta: int, content: bool) -> None:
    """Per group: the bound, its size, and nothing trained twice by trajectory id, prompt, group
    content (the same members' tokens) or member content (one trajectory's tokens in two groups)."""
    by_id: dict[int, int] = {}
    by_prompt: dict[int, int] = {}
    by_group: dict[tuple, tuple[int, int]] = {}
    by_member: dict[str, tuple[int, int]] = {}
    for r in live:
        where = (r["buffer"], r["group_id"])
        if not r["traj_version"] <= r["buffer"] <= r["traj_version"] + eta:
            a.other.append(f"group {r['group_id']} V_traj {r['traj_version']} trained in buffer {r['buffer']}")
        if len(r["traj_ids"]) < group_size:
            a.lost.append(f"group {r['group_id']} has {len(r['traj_ids'])} trajectories, not {group_size}")
        for t in r["traj_ids"]:
            if t in by_id:
                a.duplicated.append(f"trajectory {t} trained twice (buffers {by_id[t]} and {r['buffer']})")
            by_id[t] = r["buffer"]
        if "prompt_id" in r:
            if r["prompt_id"] in by_prompt:
                a.duplicated.append(
                    f"prompt {r['prompt_id']} trained twice (buffers {by_prompt[r['prompt_id']]} and {r['buffer']})"
                )
            by_prompt[r["prompt_id"]] = r["buffer"]
        if not content:
            continue
        digests = r.get("content") or []
        if len(digests) != len(r["traj_ids"]):
            a.lost.append(
                f"group {r['group_id']} (buffer {r['buffer']}) has {len(digests)} content digests for "
                f"{len(r['traj_ids'])} trajectories: what was trained is not recorded"
            )
            continue
        key = tuple(sorted(digests))
        if key in by_group:
            a.duplicated.append(f"group content of {by_group[key]} trained again as (buffer, group) {where}")
        by_group[key] = where
        for d in set(digests):
            if d in by_member and by_member[d][1] != r["group_id"]:
                a.duplicated.append(f"trajectory content {d} of {by_member[d]} trained again in {where}")
            by_member[d] = where
