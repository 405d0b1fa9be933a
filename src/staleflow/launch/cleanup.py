"""Run-file hygiene: per-run folders (control sockets) and shared-memory segments of crashed runs.

Each run owns /tmp/staleflow-<run_id>/ with a pid file of the process that created it. At the
next start, folders whose creator is dead are removed, together with the shared-memory
segments the servers left behind (staleflow.servers knows their names).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile


def run_folder(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"staleflow-{run_id}")


def claim_run_folder(run_id: str) -> str:
    folder = run_folder(run_id)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "owner.pid"), "w") as f:
        f.write(str(os.getpid()))
    return folder


def remove_run_folder(run_id: str) -> None:
    shutil.rmtree(run_folder(run_id), ignore_errors=True)


def _owner_alive(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "owner.pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale_run_files() -> list[str]:
    """Remove run folders and shared-memory segments of runs whose owner process is dead."""
    removed = []
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "staleflow-*")):
        if os.path.isdir(folder) and not _owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    try:
        from staleflow.servers import cleanup_stale_segments
    except ImportError:
        return removed
    removed.extend(cleanup_stale_segments())
    return removed
