"""Where a run lives and how it continues: run folders, elastic restarts, --resume.

    run = prepare_run(cfg, preset_cfg, given_flags(argv))   # global rank 0, before the controller starts
    run.cfg, run.run_dir, run.notes

- A new run gets a fresh folder under --log.run-dir and records it in a pointer file keyed by
  torchrun's run id, so that after an elastic restart (torchrun --max-restarts) rank 0 finds the
  same folder and resumes from its newest intact checkpoint by itself.
- ``--resume DIR`` (and an elastic restart) reload the run's saved config: a flag given now
  that changes the model or the dataset is refused in one line; other changes are applied with
  a note (e.g. more --steps).
- Rows written after the checkpoint (metrics.jsonl, trained.jsonl) are marked
  ``"superseded": true``: they describe steps that are trained again, so every audit skips them.
- Ids never repeat across a resume: the controller keeps their high-water marks in ``ids.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from staleflow.config import ConfigError, RunConfig, config_from_dict, resolve
from staleflow.durable import atomic_write_json, atomic_write_text, read_jsonl

IDS_FILE = "ids.json"
FROZEN_ON_RESUME = (
    "model.path",
    "data.source",
    "data.prompt_field",
    "data.answer_field",
    "data.seed",
    "data.chat_template",
    "data.max_prompt_tokens",
)
"""Flags a resumed run cannot change: the checkpoint's weights and the prompt cursor depend on them."""
_NOT_COMPARED = ("resume", "log.name", "log.run_dir", "log.progress")


@dataclass
class PreparedRun:
    cfg: RunConfig
    run_dir: str
    resume_from: str = ""
    """A checkpoint folder under run_dir to load (empty: start from the model's weights)."""
    notes: list[str] = field(default_factory=list)
    created: bool = False
    """The folder was created by this attempt (removed again if the run dies before any step)."""


def elastic_pointer() -> Path | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not run_id or run_id == "none":
        return None
    return Path(tempfile.gettempdir()) / f"staleflow-elastic-{''.join(c for c in run_id if c.isalnum())}.json"


def _read_pointer(pointer: Path) -> dict:
    """The pointer file's JSON object ({} if missing, unreadable or not an object)."""
    try:
        state = json.loads(pointer.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return state if isinstance(state, dict) else {}


def mark_fatal(message: str) -> None:
    """Record that the run failed on bad input: launch.sh reports it, and no restart is attempted."""
    pointer = elastic_pointer()
    if pointer is None:
        return
    state = _read_pointer(pointer)
    state["fatal"] = message
    atomic_write_json(pointer, state)


def no_restart_helps(e: BaseException) -> bool:
    """Whether an error comes from bad input or the environment, so that an elastic restart would
    fail the same way (the run then stops with exit 2 instead of restarting)."""
    from staleflow.control.hub import FatalFailure
    from staleflow.controller import RewardsFailing
    from staleflow.data import DataError
    from staleflow.durable import disk_problem
    from staleflow.model.aliases import AliasError
    from staleflow.model.hf import ModelLoadError
    from staleflow.reward.functions import RewardError
    from staleflow.train.checkpoint import CheckpointError

    return (
        isinstance(
            e,
            (
                ConfigError,
                RewardsFailing,
                DataError,
                ModelLoadError,
                RewardError,
                AliasError,
                CheckpointError,
                FatalFailure,
            ),
        )
        or disk_problem(e) is not None
    )


def is_fatal() -> bool:
    pointer = elastic_pointer()
    try:
        return bool(pointer is not None and _read_pointer(pointer).get("fatal"))
    except OSError:
        return False


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def make_run_dir(cfg: RunConfig) -> str:
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


def _flat(cfg, prefix: str = "") -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        out.update(_flat(v, key + ".") if dataclasses.is_dataclass(v) else {key: v})
    return out


def _replace_path(cfg, key: str, value):
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _replace_path(getattr(cfg, head), rest, value)})


def merge_resume_config(
    saved: RunConfig, given: RunConfig, defaults: RunConfig, flags: frozenset[str] = frozenset()
) -> tuple[RunConfig, list[str]]:
    """The saved config with the values given now applied: those named on the command line
    (``flags``, cli.given_flags) and those that differ from the preset's.

    A flag equal to the preset's value counts only through ``flags``: ``--resume RUN --steps 4``
    with a preset of 4 steps once silently kept the saved run's 50.
    Raises ConfigError for a flag in FROZEN_ON_RESUME that differs from the saved run's."""
    g, d, s = _flat(given), _flat(defaults), _flat(saved)
    notes = []
    merged = saved
    for key, value in g.items():
        if key in _NOT_COMPARED or value == s.get(key) or (value == d.get(key) and key not in flags):
            continue
        flag = "--" + key.replace("_", "-")
        if key in FROZEN_ON_RESUME:
            raise ConfigError(
                f"{flag}={value!r} differs from the resumed run's {s.get(key)!r}: a resumed run keeps "
                f"its model and dataset; start a new run instead of --resume"
            )
        merged = _replace_path(merged, key, value)
        notes.append(f"resume: {flag} {value!r} (was {s.get(key)!r})")
    return resolve(dataclasses.replace(merged, resume=given.resume)), notes


def _saved_config(run_dir: str) -> RunConfig:
    path = os.path.join(run_dir, "config.json")
    try:
        return config_from_dict(RunConfig, json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            f"--resume={run_dir!r}: cannot read its config.json ({e}); give a run folder that staleflow train created"
        ) from None


def _resume_point(run_dir: str, required: bool):
    """(newest intact checkpoint or None, warnings); with `required` (--resume) a missing one is an error."""
    from staleflow.train.checkpoint import find_resume_checkpoint

    if required and not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        raise ConfigError(
            f"--resume={run_dir!r} is not a run folder with checkpoints/: give the folder a "
            f"previous run printed as its run folder"
        )
    ckpt, warns = find_resume_checkpoint(os.path.join(run_dir, "checkpoints"))
    if required and ckpt is None:
        raise ConfigError(
            f"--resume={run_dir!r}: no intact checkpoint under {run_dir}/checkpoints "
            f"({'; '.join(warns) or 'none saved'}); start a new run without --resume"
        )
    return ckpt, warns


def check_resume(cfg: RunConfig, defaults: RunConfig, flags: frozenset[str] = frozenset()) -> RunConfig:
    """Validate --resume without touching the folder: not written by a live run, an intact
    checkpoint and a compatible config."""
    from staleflow.launch.run_lock import check_unlocked

    check_unlocked(cfg.resume)
    _resume_point(cfg.resume, required=True)
    if os.path.isfile(os.path.join(cfg.resume, "config.json")):
        cfg, _ = merge_resume_config(_saved_config(cfg.resume), cfg, defaults, flags)
    return cfg


def prepare_run(cfg: RunConfig, defaults: RunConfig, flags: frozenset[str] = frozenset()) -> PreparedRun:
    """Rank 0: the run folder and the config to run with (new run, --resume, or elastic restart)."""
    pointer = elastic_pointer()
    run_dir, notes, created = "", [], False
    if restart_count() > 0 and pointer is not None and pointer.is_file():
        run_dir = _read_pointer(pointer).get("run_dir")
        if not isinstance(run_dir, str) or not run_dir:
            raise ConfigError(f"{pointer}: field run_dir is not a folder; remove the file and --resume the run")
        notes.append(f"elastic restart {restart_count()}: continuing run {run_dir}")
        if not os.path.isdir(run_dir):
            os.makedirs(run_dir)
            created = True
    elif cfg.resume:
        run_dir = cfg.resume
    else:
        run_dir, created = make_run_dir(cfg), True
    from staleflow.launch.run_lock import lock_run_dir

    if os.path.isdir(run_dir):  # one writer per run folder (a missing --resume folder is refused below)
        lock_run_dir(run_dir)
    if pointer is not None:
        pointer.write_text(json.dumps({"run_dir": run_dir}))
    ckpt, warns = _resume_point(run_dir, required=bool(cfg.resume) and restart_count() == 0)
    notes += warns
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        cfg, more = merge_resume_config(_saved_config(run_dir), cfg, defaults, flags)
        notes += more
    version = 0
    if ckpt is not None:
        cfg = dataclasses.replace(cfg, resume=run_dir)
        version = int(ckpt.name.split("_")[1])
        notes.append(f"resuming from {ckpt} (version {version})")
    supersede_after(run_dir, version, notes)
    return PreparedRun(cfg, run_dir, str(ckpt or ""), notes, created)


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
    import shutil

    shutil.rmtree(p, ignore_errors=True)
    return True


def finish(run_id: str) -> int:
    """After torchrun ended (launch.sh): 2 if the run stopped on bad input (already reported), else 0.
    Removes the run's pointer file either way."""
    os.environ["TORCHELASTIC_RUN_ID"] = run_id
    fatal = is_fatal()
    pointer = elastic_pointer()
    if pointer is not None:
        pointer.unlink(missing_ok=True)
    return 2 if fatal else 0


if __name__ == "__main__":
    import sys

    sys.exit(finish(sys.argv[1]))
