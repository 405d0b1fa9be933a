"""One writer per run folder: ``run.lock`` (an fcntl lock and the holder's pid).

    lock_run_dir("runs/x")     # rank 0, before it writes anything there; held until it exits
    check_unlocked("runs/x")   # staleflow check --resume: refuse a folder a live run writes
    check_visible("runs/x", home=0, node=1)   # a trainer rank on another node: it writes shards there

The lock is ``flock`` on ``<run>/run.lock``: the kernel releases it when its holder dies however it
dies, so a lock file left by a dead run is simply taken over (its pid rewritten). A lock path that is
not a regular file (a FIFO, a device, a symlink) is refused before any open. A second run or
``--resume`` on a folder whose lock is held is refused in one line naming the live pid (exit 2):
two runs appending to one ``metrics.jsonl`` and writing one ``checkpoints/`` would corrupt both.
"""

from __future__ import annotations

import fcntl
import os
import stat

from staleflow.faults import ConfigError
from staleflow.inputs import special_file

LOCK_FILE = "run.lock"
_HELD: dict[str, int] = {}
"""Run folder (real path) -> the open, locked file of this process."""


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "?"
    return text if text.isdigit() else "?"


def _refusal(run_dir: str, pid: str) -> ConfigError:
    return ConfigError(
        f"{run_dir} is being written by a live run (pid {pid}, {os.path.join(run_dir, LOCK_FILE)}): wait for it "
        f"to end or stop it (kill {pid}), then --resume {run_dir}"
    )


def _not_a_lock_file(path: str) -> None:
    """ConfigError when ``path`` exists and is not a regular file (a FIFO would block its reader for
    ever, and flock refuses one): refused before any open."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"cannot read the run folder's lock {path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a symlink" if stat.S_ISLNK(mode) else (special_file(path) or "not a regular file").removeprefix("is ")
        raise ConfigError(
            f"the run folder's lock {path} is {kind.split(',')[0]}, not a file: remove it (rm {path}) and retry"
        )


def lock_run_dir(run_dir: str) -> None:
    """Take the run folder's lock for the life of this process; ConfigError if a live run holds it."""
    key = os.path.realpath(run_dir)
    if key in _HELD:
        return
    path = os.path.join(run_dir, LOCK_FILE)
    _not_a_lock_file(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise ConfigError(
            f"cannot open the run folder's lock {path}: {e.strerror}; remove it if it is not a file"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _holder(fd)
        os.close(fd)
        raise _refusal(run_dir, pid) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[key] = fd


def release_run_dir(run_dir: str) -> None:
    fd = _HELD.pop(os.path.realpath(run_dir), None)
    if fd is not None:
        os.close(fd)


def check_unlocked(run_dir: str) -> None:
    """ConfigError if a live run (another process) holds the folder's lock; touches nothing."""
    if os.path.realpath(run_dir) in _HELD:
        return
    _not_a_lock_file(os.path.join(run_dir, LOCK_FILE))
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # no lock file (a run from before locks, or none yet): nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _refusal(run_dir, _holder(fd)) from None
    finally:
        os.close(fd)


def check_visible(run_dir: str, home: int, node: int) -> None:
    """ConfigError unless this process sees the run folder rank 0 made and locked (on node ``home``):
    trainer ranks on every node write their checkpoint shards into it, so it must live on a file
    system every trainer node mounts at the same path. A folder of that name without the lock is
    another machine's folder, not the run's."""
    if not os.path.isfile(os.path.join(run_dir, LOCK_FILE)):
        raise ConfigError(
            f"the run folder {run_dir} (made on node {home}) is not visible on node {node}: trainer ranks on "
            f"several nodes write their checkpoint shards there; set --log.run-dir to a file system every node shares"
        )
