"""Process liveness by pid, one place for every watcher (the hub's ranks, a rank's controller, the lifeline,
the owners of run folders and shared-memory segments). Pure standard library: no torch.

    pid_alive(pid)                       # exists and is not a zombie (a dead child not yet reaped)
    pid_alive(pid, start_time)           # ... and is still the process that had that start time (no pid reuse)
    pid_start_time(pid)                  # the kernel's start time of a process, 0 when unknown

A SIGSTOPped process is alive: liveness is not progress (docs/recovery.md has the stall detector).
"""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat after the command name (state first), None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def pid_start_time(pid: int) -> int:
    """Kernel start time of a process (clock ticks since boot), 0 when unknown: guards against pid reuse."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else 0
    except (ValueError, IndexError):
        return 0


def pid_alive(pid: int, start_time: int = 0) -> bool:
    """Whether process ``pid`` exists, is not a zombie and (``start_time`` given, not 0) is the process that
    started then, not a later one that reused the pid. A process of another user counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no /proc (or it vanished meanwhile): kill(0) said it exists
    if fields and fields[0] == b"Z":
        return False
    try:
        return start_time == 0 or int(fields[19]) == start_time
    except (ValueError, IndexError):
        return True
