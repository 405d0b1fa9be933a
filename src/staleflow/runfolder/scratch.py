"""Per-run scratch folders (control sockets), their owner pid, and the leftovers of crashed runs.

Each run owns /tmp/staleflow-run-<run_id>/ with a pid file of the process that created it. At
the next start, such folders whose creator is dead are removed (a folder without our pid file
is never touched), together with the shared-memory segments the servers left behind
(staleflow.servers knows their names).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from staleflow.pids import pid_alive  # (its callers import it from here too: one definition, staleflow/pids.py)

RUN_FOLDER_PREFIX = "staleflow-run-"
OWNER_FILE = "owner.pid"


def run_folder(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{RUN_FOLDER_PREFIX}{run_id}")


def claim_run_folder(run_id: str) -> str:
    folder = run_folder(run_id)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return folder


def remove_run_folder(run_id: str) -> None:
    shutil.rmtree(run_folder(run_id), ignore_errors=True)


def _owner_alive(folder: str) -> bool:
    """False only when the folder's pid file names a process that no longer exists."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return True  # not (or not yet) a claimed run folder: never ours to delete
    return pid_alive(pid)


def cleanup_stale_run_files() -> list[str]:
    """Remove run folders and shared-memory segments of runs whose owner process is dead."""
    removed = []
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), RUN_FOLDER_PREFIX + "*")):
        if os.path.isdir(folder) and not _owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    try:
        from staleflow.servers import cleanup_stale_segments
    except ImportError:
        return removed
    removed.extend(cleanup_stale_segments())
    return removed
