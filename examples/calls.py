"""Call records for the worked examples: with STALEFLOW_EXAMPLE_CALLS=FILE in the environment, each
example appends one line per call, ``<name> <pid>``, so a test (or you) can see that the fork's own
code ran in the run and no built-in in its place. Without the variable nothing is written."""

from __future__ import annotations

import os


def record(name: str) -> None:
    path = os.environ.get("STALEFLOW_EXAMPLE_CALLS")
    if path:
        with open(path, "a") as f:  # one short write per line: lines of several processes do not mix
            f.write(f"{name} {os.getpid()}\n")
