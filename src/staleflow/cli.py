"""Command line: ``python -m staleflow {train,check,plan,sim,eval} [--preset NAME] [--flags ...]``.

``train`` runs inside torchrun (``./launch.sh`` starts it); ``plan`` prints the memory plan of a
run's flags (per rank and GPU, no GPU needed); ``sim`` runs the discrete-event simulator in one
process; ``eval`` scores a model or a run's exported policy on a task (accuracy with its 95%
interval, one JSON line). Each subcommand parses its own config tree with tyro; ``--preset``
picks the defaults that the flags then override.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence, TypeVar

from staleflow.config import ConfigError

T = TypeVar("T")

SUBCOMMANDS = {
    "train": "staleflow.launch.entry:main",
    "check": "staleflow.launch.check:main",
    "plan": "staleflow.plan.cli:main",
    "sim": "staleflow.sim.cli:main",
    "eval": "staleflow.eval.command:main",
}


def split_preset(argv: Sequence[str], presets: dict[str, Callable[[], T]], default: str) -> tuple[T, list[str]]:
    """Remove ``--preset NAME`` (or ``--preset=NAME``) from argv and build that preset's config."""
    argv = list(argv)
    name = default
    for i, arg in enumerate(argv):
        if arg == "--preset":
            if i + 1 >= len(argv):
                raise ConfigError(f"--preset needs a name; choose one of: {', '.join(presets)}")
            name = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--preset="):
            name = arg.split("=", 1)[1]
            del argv[i]
            break
    if name not in presets:
        raise ConfigError(f"--preset={name!r} is unknown; choose one of: {', '.join(presets)}")
    return presets[name](), argv


def parse(cls: type[T], argv: Sequence[str], presets: dict[str, Callable[[], T]], default: str, prog: str) -> T:
    """Parse a config dataclass from argv with tyro, starting from a preset."""
    import tyro

    base, rest = split_preset(argv, presets, default)
    description = f"{cls.__doc__ or ''}\n\nPresets (--preset NAME): {', '.join(presets)} (default {default})."
    return tyro.cli(cls, args=rest, default=base, prog=prog, description=description)


def given_flags(argv: Sequence[str]) -> frozenset[str]:
    """The dotted config keys the command line names: ``--rollout.max-new-tokens 24`` and
    ``--rollout.max_new_tokens=24`` give ``rollout.max_new_tokens``; ``--log.no-progress`` gives
    ``log.progress`` (and ``log.no_progress``). A resumed run applies these even where they equal
    the preset's value (launch/resume.merge_resume_config)."""
    out = set()
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name = tok[2:].split("=", 1)[0].replace("-", "_")
            head, dot, last = name.rpartition(".")
            out.add(name)
            if last.startswith("no_"):
                out.add(f"{head}{dot}{last[3:]}")
    return frozenset(out)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: python -m staleflow {train,check,plan,sim,eval} [--preset NAME] [--help] [flags...]",
              file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown subcommand {argv[0]!r}; choose one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module_name, fn_name = SUBCOMMANDS[argv[0]].split(":")
    import importlib

    fn = getattr(importlib.import_module(module_name), fn_name)
    try:
        code = fn(argv[1:])
    except ConfigError as e:
        print(f"staleflow: config error: {e}", file=sys.stderr)
        sys.exit(2)
    if argv[0] == "train":
        _leave(code or 0)
    sys.exit(code or 0)


def _leave(code: int) -> None:
    """End a rank process without the interpreter's shutdown.

    A gloo worker thread frees each finished collective's tensors after the caller's wait
    returns; when that frees a Python-owned tensor while the interpreter is finalizing, the thread
    cannot take the GIL and the process aborts ("terminate called without an active exception",
    SIGABRT), which torchrun reads as a failed worker. Everything a rank owns (servers, sockets,
    the controller process) is closed before ``main`` returns, so only the buffers are left."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
