"""Crash-safe files: atomic rewrites, JSONL logs that survive a torn last line, disk-full named.

    atomic_write_text(path, text)        # temp file + fsync + rename + directory fsync
    atomic_write_json(path, obj)
    rows, torn = read_jsonl(path)        # a torn (half-written) line is skipped and counted
    with disk_errors("writing checkpoint step_00000005"):
        ...                              # ENOSPC / EDQUOT / EFBIG / EROFS / EACCES become DiskError, one line

A file the run rewrites (config, ids, trainer state, manifests, markers) is never seen half
written: readers find the old or the new content. Append-only logs (metrics.jsonl, trained.jsonl)
can lose their last line in a crash; readers report and ignore it instead of failing a resume.
Nothing here parses anything but JSON: no file a run reads can run code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

_NO_ROOM = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    # RLIMIT_FSIZE (ulimit -f; Python ignores SIGXFSZ, so the write fails) or the file system's limit
    errno.EFBIG: "a file would exceed the file size limit (ulimit -f) or the file system's largest file",
}
_NO_WRITE = {
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


class DiskError(OSError):
    """A write failed for a reason no restart fixes by itself (full, read-only, not permitted)."""

    def __str__(self) -> str:
        return str(self.strerror)


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new file in ``path`` durable (the directory entry itself)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` fills a temporary sibling, which is fsynced and renamed over ``path``.

    A crash at any point leaves the old file (or none) and at most a ``.tmp`` sibling; an
    error removes the sibling at once."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def atomic_write_json(path: str | Path, obj, indent: int | None = None) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent))


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_jsonl(path: str | Path) -> tuple[list[dict], int]:
    """The rows of a JSONL file and how many lines could not be parsed (a torn last line after a
    crash; damage elsewhere is counted the same way). A missing file has no rows."""
    rows, bad = [], 0
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")  # no newline translation of a lone \r
    except FileNotFoundError:
        return [], 0
    for line in text.split("\n"):  # JSONL lines end in \n only (splitlines also splits at \x0b, \x1c, ...)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: a line of 100,000 nested brackets
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def disk_problem(e: BaseException) -> str | None:
    """What a failed write means for the user when no retry can fix it, else None."""
    if isinstance(e, OSError) and e.errno is not None:
        return _NO_ROOM.get(e.errno) or _NO_WRITE.get(e.errno)
    return None


@contextmanager
def disk_errors(doing: str, where: str | Path = ""):
    """Turn an OSError that no restart fixes into a DiskError naming what was being done, where
    and what to do; other errors pass through unchanged."""
    try:
        yield
    except OSError as e:
        why = disk_problem(e)
        if why is None or isinstance(e, DiskError):
            raise
        place = f" in {where}" if where else (f" ({e.filename})" if e.filename else "")
        fix = (
            "free space there or point --log.run-dir at a bigger disk"
            if e.errno in _NO_ROOM
            else "make it writable or point --log.run-dir elsewhere"
        )
        raise DiskError(e.errno, f"{doing} failed{place}: {why}; {fix}") from None
