"""A run folder never chooses code: the extension specs a resumed run reads back from its saved
config.json are held to more than the ones the user types.

    check_saved_code(merged, given, run_dir)   # after merge_resume_config; ConfigError (one line) or None

An extension spec (``--mode``, ``--reward.fn``, ``--train.loss`` / ``advantage`` / ``off-policy``,
``--coordinator.routing`` / ``pull``, ``--rollout.engine``, ``--env.name``, a task named by
``--data.source`` / ``--data.mix``) is code: an import path 'package.module:name' is imported by every
process of the run. Whoever can write a run folder can rewrite its config.json, so a spec that comes
from there (the resumed value differs from what this command line, its --config file and its preset
give) is accepted only when it is

- a registered name (no ':'): the built-ins and what installed packages register; or
- an import path whose module, located by the import system's finders without running it
  (extensions.module_files), lies entirely outside the working directory and outside every run
  folder: an installed package (site-packages, a folder on PYTHONPATH elsewhere).

Anything else is refused in one line naming the flag to pass: a spec named again on the command line
is the user's choice and resolves as a new run's does (extensions.Registry.resolve, which refuses a
module inside a run folder whoever names it).
"""

from __future__ import annotations

import os

from staleflow.config import ConfigError, RunConfig
from staleflow.extensions import import_refusal, module_files

CODE_FLAGS = (
    "mode",
    "reward.fn",
    "train.loss",
    "train.advantage",
    "train.off_policy",
    "coordinator.routing",
    "coordinator.pull",
    "rollout.engine",
    "env.name",
)
"""Config keys whose value may be an import path (docs/extending.md); data sources are checked apart."""


def _value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _is_import_path(spec: str) -> bool:
    return isinstance(spec, str) and ":" in spec


def _is_task_path(name: str) -> bool:
    """A --data.source entry that names a task function by import path (data/tasks.task_for's rule)."""
    from pathlib import Path

    from staleflow.data.errors import SUFFIXES

    return ":" in name and "/" not in name and Path(name).suffix not in SUFFIXES


def saved_specs(merged: RunConfig, given: RunConfig) -> list[tuple[str, str]]:
    """(flag, spec) of every import path the resumed config takes from the saved config.json."""
    out = []
    for key in CODE_FLAGS:
        spec = _value(merged, key)
        if spec != _value(given, key) and _is_import_path(spec):
            out.append(("--" + key.replace("_", "-"), spec))
    named_now = {name for name, _ in given.data.sources}
    flag = "--data.mix" if merged.data.mix else "--data.source"
    out += [(flag, name) for name, _ in merged.data.sources if name not in named_now and _is_task_path(name)]
    return out


def check_saved_code(merged: RunConfig, given: RunConfig, run_dir: str) -> None:
    """ConfigError (one line naming the flag to pass) for a saved spec that would choose code (module docstring)."""
    cwd = os.getcwd()
    for flag, spec in saved_specs(merged, given):
        module = spec.partition(":")[0]
        head = f"--resume={run_dir!r}: its saved config.json sets {flag}={spec!r}"
        if module_files(module) is None:
            raise ConfigError(
                f"{head}, whose module cannot be found outside any run folder; a saved config never chooses code "
                f"to import: pass {flag} again (a registered name or your own module) to resume"
            )
        refusal = import_refusal(module, also_under=((cwd, "the working directory"),))
        if refusal is None:
            continue
        if "working directory" in refusal:
            raise ConfigError(
                f"{head}, and {refusal}: a saved config never chooses code to import from there; to resume "
                f"with it, name it again on the command line: {flag} {spec}"
            )
        raise ConfigError(f"{head}, and {refusal}: pass {flag} again (a registered name or your own module) to resume")
