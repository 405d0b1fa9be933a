"""The run folder (--log.run-dir/--log.name): created empty, its rows superseded on a resume, its id
high-water marks, and its removal when a run died while starting.

    path = make_run_dir(cfg)                 # a new run (rank 0)
    supersede_after(path, version, notes)    # a resume from `version`: later rows are marked
    write_ids(path, next_traj, next_group)   # the controller, every step; read_ids on resume

- Rows written after the checkpoint (metrics.jsonl, trained.jsonl) are marked
  ``"superseded": true``: they describe steps that are trained again, so every audit skips them.
- Ids never repeat across a resume: the controller keeps their high-water marks in ``ids.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from staleflow.durable import atomic_write_json, atomic_write_text, read_jsonl
from staleflow.faults import ConfigError

IDS_FILE = "ids.json"


def make_run_dir(cfg) -> str:
    """The run folder: --log.run-dir/--log.name (default: a timestamp), created empty."""
    name = cfg.log.name or time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(cfg.log.run_dir, name)
    if cfg.log.name and os.path.exists(path) and os.listdir(path):
        raise ConfigError(f"--log.name={cfg.log.name!r}: {path} already exists; choose another name or --resume {path}")
    n = 1
    while os.path.exists(path):
        path, n = os.path.join(cfg.log.run_dir, f"{name}-{n}"), n + 1
    os.makedirs(path)
    return path


def supersede_after(run_dir: str, version: int, notes: list[str] | None = None) -> int:
    """Mark rows of steps >= version superseded (they will be trained again); returns how many.

    A line torn by a crash (half written) is dropped, said in ``notes``, and the file rewritten
    whole (atomically), so the resumed run appends after a clean line."""
    n = 0
    for name, key in (("metrics.jsonl", "step"), ("trained.jsonl", "buffer")):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        rows, torn = read_jsonl(path)
        changed = 0
        for row in rows:
            at = row.get(key)
            if type(at) is int and at >= version and not row.get("superseded"):
                row["superseded"] = True
                changed += 1
        if torn and notes is not None:
            notes.append(f"{path}: dropped {torn} unreadable line(s) (torn by a crash)")
        if changed or torn:
            atomic_write_text(path, "".join(json.dumps(r, sort_keys=name == "metrics.jsonl") + "\n" for r in rows))
            n += changed
    return n


def read_ids(run_dir: str) -> dict:
    """The id high-water marks of ``ids.json``: only its non-negative integer fields ({} if unreadable)."""
    try:
        ids = json.loads((Path(run_dir) / IDS_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(ids, dict):
        return {}
    return {k: v for k, v in ids.items() if k in ("next_traj", "next_group") and type(v) is int and 0 <= v < 2**62}


def write_ids(run_dir: str, next_traj: int, next_group: int) -> None:
    atomic_write_json(Path(run_dir) / IDS_FILE, {"next_traj": next_traj, "next_group": next_group})


def remove_if_empty(run_dir: str) -> bool:
    """Remove a run folder that holds no step and no checkpoint (a run that died while starting)."""
    p = Path(run_dir)
    if not p.is_dir() or (p / "checkpoints").is_dir():
        return False
    metrics = p / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return False
    shutil.rmtree(p, ignore_errors=True)
    return True
