"""How a run starts or continues: a new run, --resume, or an elastic restart (rank 0, before the
controller starts). The run folder itself, its lock, ids and the elastic pointer are in runfolder/.

    run = prepare_run(cfg, preset_cfg, given_flags(argv))   # global rank 0, before the controller starts
    run.cfg, run.run_dir, run.notes

- A new run gets a fresh folder under --log.run-dir and records it in a pointer file keyed by
  torchrun's run id (runfolder/elastic.py), so that after an elastic restart (torchrun --max-restarts)
  rank 0 finds the same folder and resumes from its newest intact checkpoint by itself.
- ``--resume DIR`` (and an elastic restart) reload the run's saved config: a flag given now
  that changes the model or the dataset is refused in one line; other changes are applied with
  a note (e.g. more --steps). Rows after the checkpoint are marked superseded (runfolder/run_dir.py).
- A saved config never chooses code: an extension spec read back from it is refused unless it is a
  registered name or an installed module outside the working directory and every run folder
  (launch/saved_code.py); and no process imports an extension module from a run folder
  (extensions.protect_folders).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from staleflow.config import ConfigError, RunConfig, config_from_dict, resolve
from staleflow.config.moved import upgrade
from staleflow.extensions import protect_folders
from staleflow.launch.saved_code import check_saved_code
from staleflow.runfolder.elastic import elastic_pointer, read_pointer, restart_count
from staleflow.runfolder.lock import check_unlocked, lock_run_dir
from staleflow.runfolder.run_dir import make_run_dir, supersede_after

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
    return dataclasses.replace(merged, resume=given.resume), notes


def _saved_config(run_dir: str) -> tuple[RunConfig, list[str]]:
    """(the run's saved config, notes on keys a later version moved: config/moved.py); ConfigError for an
    unreadable config.json or a key this version does not know (never dropped: the run would resume
    with another setting than it was started with)."""
    path = os.path.join(run_dir, "config.json")
    try:
        saved = json.loads(Path(path).read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
        saved, moved = upgrade(saved, dataclasses.asdict(RunConfig()))
        unknown: list[str] = []
        cfg = config_from_dict(RunConfig, saved, unknown)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            f"--resume={run_dir!r}: cannot read its config.json ({e}); give a run folder that staleflow train created"
        ) from None
    if unknown:
        raise ConfigError(
            f"--resume={run_dir!r}: its config.json sets {', '.join(unknown)}, which this version of StaleFlow "
            f"does not know (the run was started by another version): resume it with that version, or start a new run"
        )
    return cfg, [f"resume: {m}" for m in moved]


def resumed_config(run_dir: str, cfg: RunConfig, defaults: RunConfig, flags: frozenset[str]):
    """(the run's saved config with this command line's changes, notes); ConfigError when a change is
    refused or a saved extension spec would choose code (launch/saved_code.py)."""
    saved, moved = _saved_config(run_dir)
    merged, notes = merge_resume_config(saved, cfg, defaults, flags)
    check_saved_code(merged, cfg, run_dir)  # before resolve: a fork's --mode is imported there
    return resolve(merged), moved + notes


def protect_run_folders(cfg: RunConfig, run_dir: str) -> None:
    """No extension module is ever imported from the run folder, nor from --log.run-dir (unless that
    holds the working directory itself), in this process and those it starts."""
    runs = os.path.realpath(cfg.log.run_dir)
    cwd = os.path.realpath(os.getcwd())
    holds_cwd = cwd == runs or cwd.startswith(runs.rstrip(os.sep) + os.sep)
    protect_folders(run_dir, "" if holds_cwd else runs)


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
    protect_run_folders(cfg, cfg.resume)
    check_unlocked(cfg.resume)
    _resume_point(cfg.resume, required=True)
    if os.path.isfile(os.path.join(cfg.resume, "config.json")):
        cfg, _ = resumed_config(cfg.resume, cfg, defaults, flags)
    return cfg


def prepare_run(cfg: RunConfig, defaults: RunConfig, flags: frozenset[str] = frozenset()) -> PreparedRun:
    """Rank 0: the run folder and the config to run with (new run, --resume, or elastic restart)."""
    pointer = elastic_pointer()
    run_dir, notes, created = "", [], False
    if restart_count() > 0 and pointer is not None and pointer.is_file():
        run_dir = read_pointer(pointer).get("run_dir")
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
    protect_run_folders(cfg, run_dir)
    if os.path.isdir(run_dir):  # one writer per run folder (a missing --resume folder is refused below)
        lock_run_dir(run_dir)
    if pointer is not None:
        pointer.write_text(json.dumps({"run_dir": run_dir}))
    ckpt, warns = _resume_point(run_dir, required=bool(cfg.resume) and restart_count() == 0)
    notes += warns
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        cfg, more = resumed_config(run_dir, cfg, defaults, flags)
        notes += more
    version = 0
    if ckpt is not None:
        cfg = dataclasses.replace(cfg, resume=run_dir)
        version = int(ckpt.name.split("_")[1])
        notes.append(f"resuming from {ckpt} (version {version})")
    supersede_after(run_dir, version, notes)
    return PreparedRun(cfg, run_dir, str(ckpt or ""), notes, created)
