"""The elastic pointer: how an elastic restart (torchrun --max-restarts) finds its run, and how a
run that failed on bad input tells launch.sh not to restart it.

    pointer = elastic_pointer()     # /tmp/staleflow-elastic-<TORCHELASTIC_RUN_ID>.json, or None
    mark_fatal("DataError: ...")    # the controller, on a fault the table calls fatal (faults.py)
    python -m staleflow.runfolder.elastic RUN_ID    # launch.sh after torchrun: exit 2 if marked fatal

The pointer holds ``{"run_dir": ...}`` (written by rank 0 at start, launch/resume.prepare_run) and,
after a fatal fault, ``"fatal": message``. It is JSON only, written atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from staleflow.durable import atomic_write_json


def elastic_pointer() -> Path | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not run_id or run_id == "none":
        return None
    return Path(tempfile.gettempdir()) / f"staleflow-elastic-{''.join(c for c in run_id if c.isalnum())}.json"


def read_pointer(pointer: Path) -> dict:
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
    state = read_pointer(pointer)
    state["fatal"] = message
    atomic_write_json(pointer, state)


def is_fatal() -> bool:
    pointer = elastic_pointer()
    try:
        return bool(pointer is not None and read_pointer(pointer).get("fatal"))
    except OSError:
        return False


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


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
