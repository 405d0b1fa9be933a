"""Command line: ``python -m staleflow {train,check,plan,sim,eval} [--preset NAME] [--config FILE] [--flags ...]``.

``train`` runs inside torchrun (``./launch.sh`` starts it); ``plan`` prints the memory plan of a
run's flags (per rank and GPU, no GPU needed); ``sim`` runs the discrete-event simulator in one
process; ``eval`` scores a model or a run's exported policy on a task (accuracy with its 95%
interval, one JSON line). Each subcommand parses its own config tree with tyro; ``--preset``
picks the defaults that the flags then override.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from staleflow.config import ConfigError
from staleflow.launch.import_path import working_directory_off

SUBCOMMANDS = {
    "train": "staleflow.launch.entry:main",
    "check": "staleflow.launch.check:main",
    "plan": "staleflow.plan.cli:main",
    "sim": "staleflow.sim.cli:main",
    "eval": "staleflow.eval.command:main",
}
ABOUT = {
    "train": "one rank of a training run, under torchrun (./launch.sh starts the whole run: use that)",
    "check": "check a run's flags, model, data and machine before any process starts (launch.sh runs it)",
    "plan": "print a run's memory plan per rank and GPU, and whether it fits (no GPU needed)",
    "sim": "simulate StaleFlow and its baselines on a modelled cluster (one process, no GPU)",
    "eval": "score a model or a run's exported policy on a task: accuracy with its 95% interval",
}
"""What each subcommand does, in one line: ``python -m staleflow --help`` and each one's own --help."""


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {ABOUT[name]}" for name in SUBCOMMANDS]
    return (
        "usage: python -m staleflow COMMAND [--preset NAME] [--config FILE] [flags...]\n\n"
        "commands:\n" + "\n".join(lines) + "\n\n"
        "python -m staleflow COMMAND --help lists a command's flags. A training run: ./launch.sh [train flags]\n"
        "(./launch.sh --help)."
    )


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None:  # the process's own command line (not a caller's argv): its import path, first
        working_directory_off()  # before any subcommand imports transformers (launch/import_path.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0)
    if not argv or argv[0] not in SUBCOMMANDS:
        print(usage(), file=sys.stderr)
        if argv:
            print(f"error: unknown subcommand {argv[0]!r}; choose one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        sys.exit(2)
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
