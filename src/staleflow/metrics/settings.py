"""Which settings two sets of runs differ in (each run's config.json), so that a comparison says what
it compares: a mode and eta, or also a changed default, another version's new setting, another model.

    settings = run_settings(records.read_config(run))  # {'staleness.eta': '3', ...}, moved keys put where they went
    rows = settings_diff(runs_a, runs_b)                # [{"key", "a", "b", "default"}]: first run of each side
    keys = mixed_settings(runs_a)                       # settings whose value varies among one side's own runs

Values are JSON text. A key only one side's config has (a version that added a setting) reads ABSENT
on the other; ``default`` says whether the side that has it holds today's default there (nothing
changed in effect). A config saved before a key moved is upgraded first (config/moved.py). The seed,
the names and the folders a paired comparison varies on purpose are left out.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from staleflow.config.moved import upgrade

ABSENT = "(absent)"
MAX_SETTINGS = 4096
"""Settings read from one config.json at most (today's config has ~200)."""
VARIED_ON_PURPOSE = ("seed", "data.seed", "resume", "log.")
"""Settings (or prefixes, ending in '.') left out: pairing keys and where a run was written."""


def flatten(cfg: dict, limit: int = MAX_SETTINGS) -> dict[str, str]:
    """{'staleness.eta': '3', ...}: each leaf as JSON text of at most 200 characters; ValueError past limit."""
    out: dict[str, str] = {}

    def walk(node: dict, prefix: str, depth: int) -> None:
        for key, value in node.items():
            if len(out) >= limit:
                raise ValueError(f"more than {limit} settings")
            if isinstance(value, dict) and depth < 8:
                walk(value, f"{prefix}{key}.", depth + 1)
            else:
                out[f"{prefix}{key}"[:200]] = json.dumps(value, default=str)[:200]

    walk(cfg, "", 0)
    return out


@functools.cache
def _defaults() -> tuple[dict, dict[str, str]]:
    from staleflow.config import RunConfig

    nested = json.loads(json.dumps(dataclasses.asdict(RunConfig()), default=str))
    return nested, flatten(nested)


def run_settings(cfg: dict | None) -> dict[str, str]:
    """A run's config.json, moved keys put where they went, flattened; {} without one."""
    if cfg is None:
        return {}
    return flatten(upgrade(cfg, _defaults()[0])[0])


def _compared(key: str) -> bool:
    return not any(key == v or (v.endswith(".") and key.startswith(v)) for v in VARIED_ON_PURPOSE)


def settings_diff(runs_a: list[dict], runs_b: list[dict]) -> list[dict]:
    """The settings in which A's first run and B's first run differ, sorted by key."""
    a, b = runs_a[0].get("settings", {}), runs_b[0].get("settings", {})
    defaults = _defaults()[1]
    rows = []
    for k in sorted(k for k in set(a) | set(b) if _compared(k) and a.get(k, ABSENT) != b.get(k, ABSENT)):
        va, vb = a.get(k, ABSENT), b.get(k, ABSENT)
        held = vb if va == ABSENT else va if vb == ABSENT else None
        rows.append({"key": k, "a": va, "b": vb, "default": held is not None and defaults.get(k) == held})
    return rows


def mixed_settings(runs: list[dict]) -> list[str]:
    """Settings whose value is not the same in every run of one side (beyond the seed and the names)."""
    keys = set().union(*(r.get("settings", {}) for r in runs))
    return sorted(k for k in keys if _compared(k) and len({r.get("settings", {}).get(k, ABSENT) for r in runs}) > 1)


def describe(diff: list[dict], limit: int = 16) -> list[str]:
    """Printable lines: every setting that differs in effect, then the count of those only one side's
    config has at today's default (a later version's setting, off or neutral)."""
    shown = [d for d in diff if not d["default"]]
    lines = [f"  {d['key']}: {d['a']} -> {d['b']}" for d in shown[:limit]]
    if len(shown) > limit:
        lines.append(f"  ... and {len(shown) - limit} more (--json has them all)")
    quiet = [d["key"] for d in diff if d["default"]]
    if quiet:
        lines.append(
            f"  and {len(quiet)} that only one side's config has, at today's default (a version that added them)"
        )
    return lines
