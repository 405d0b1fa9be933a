"""Named shared-memory segments for the data plane: creation, attach, cleanup, crash recovery.

A segment is a file in /dev/shm (tmpfs: pages are shared memory) mapped with mmap. We use
files rather than ``multiprocessing.shared_memory`` so that no resource tracker unlinks a
segment behind our back when a *reader* exits (Python < 3.13 registers attached segments too).

Every segment starts with a 64-byte prefix that records who created it:

    magic b"STLFSEG1" | kind u32 | pid u32 | pid start time u64 | payload size u64 | reserved

Names are ``staleflow-<run_id>-<what>`` (``-ts-<rank>`` for trajectory rings, ``-ps-<slot>``
for parameter-server slots). The creating process unlinks its segments at exit (a
``weakref.finalize`` per segment, which also runs at interpreter exit); a run that crashed
(SIGKILL, OOM) leaves its files behind, and ``cleanup_stale_segments()`` at the next start
removes every segment whose creating process is gone.

Usage::

    seg = Segment.create("staleflow-r1-ts-0", nbytes, kind=KIND_RING)   # creator
    seg = Segment.attach("staleflow-r1-ts-0")                           # any reader
    seg.u8            # torch.uint8 tensor over the whole payload (no copy)
    seg.close(); seg.unlink()
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import struct
import time
import weakref
from collections.abc import Callable

import torch

from staleflow.pids import pid_alive, pid_start_time
from staleflow.servers.errors import SegmentError

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
PREFIX = "staleflow-"
MAGIC = b"STLFSEG1"
PREFIX_BYTES = 64
KIND_RING = 1
KIND_PARAM = 2
KIND_PIECE = 3
_PREFIX = struct.Struct("<8sIIQQ")  # magic, kind, pid, start time, payload size
_RUN_ID = re.compile(r"^[A-Za-z0-9_.]{1,64}$")


def check_run_id(run_id: str) -> str:
    """Run ids become file names: letters, digits, '_' and '.' only (no '-', it separates fields)."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise SegmentError(f"run_id={run_id!r} is invalid: use 1-64 letters, digits, '_' or '.'")
    return run_id


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _check_owned(fd: int, path: str) -> None:
    """A segment is ours only if this user created it as a private regular file (0600): a file
    that another local user planted under the name before the run created it is refused."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SegmentError(f"segment {path} is not a regular file: remove it")
    if st.st_uid != os.getuid():
        raise SegmentError(
            f"segment {path} belongs to uid {st.st_uid}, not this user ({os.getuid()}): another user "
            f"created it; remove it or pick another run id"
        )
    if st.st_mode & 0o077:
        raise SegmentError(
            f"segment {path} has mode {stat.S_IMODE(st.st_mode):o}, segments are created 0600: "
            f"someone else made or changed it; remove it"
        )


def _unlink_if_owner(path: str, owner_pid: int) -> None:
    """Finalizer: only the creating process unlinks (a forked child must not)."""
    if os.getpid() == owner_pid:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Segment:
    """One mapped shared-memory file.

    ``u8`` (a uint8 tensor) and ``buf`` (a memoryview) both cover the payload after the prefix;
    users that derive views from them must drop those views before ``close()``.
    """

    def __init__(self, name: str, mm: mmap.mmap, size: int, kind: int, owner: bool):
        self.name, self.size, self.kind, self.owner = name, size, kind, owner
        self._mm = mm
        self.buf = memoryview(mm)[PREFIX_BYTES : PREFIX_BYTES + size]  # for struct.pack_into/unpack_from
        self.u8 = torch.frombuffer(mm, dtype=torch.uint8)[PREFIX_BYTES : PREFIX_BYTES + size]  # [size], shared
        self._finalizer = weakref.finalize(self, _unlink_if_owner, segment_path(name), os.getpid()) if owner else None

    @classmethod
    def create(cls, name: str, nbytes: int, kind: int, init: Callable[[memoryview], None] | None = None) -> Segment:
        """Create (exclusively) and map a zero-filled segment with a payload of ``nbytes``.

        ``init(payload)`` fills the payload (headers, layouts, handles) BEFORE the file appears
        under its name, so an attacher that finds the file always finds it initialised.
        """
        if nbytes <= 0:
            raise SegmentError(f"segment {name}: nbytes={nbytes} is invalid: must be > 0")
        path = segment_path(name)
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, PREFIX_BYTES + nbytes)
            mm = mmap.mmap(fd, PREFIX_BYTES + nbytes)
        finally:
            os.close(fd)
        pid = os.getpid()
        mm[: _PREFIX.size] = _PREFIX.pack(MAGIC, kind, pid, pid_start_time(pid), nbytes)
        if init is not None:
            payload = memoryview(mm)[PREFIX_BYTES : PREFIX_BYTES + nbytes]
            try:
                init(payload)
            except BaseException:
                payload.release()
                mm.close()
                os.unlink(tmp)
                raise
            payload.release()
        try:  # publish atomically: an attacher never sees a half-initialised file
            os.link(tmp, path)
        except FileExistsError:
            mm.close()
            os.unlink(tmp)
            raise SegmentError(
                f"segment {path} already exists: another run uses this run_id, or a crashed "
                f"run left it (call cleanup_stale_segments() or pick a new run_id)"
            ) from None
        os.unlink(tmp)
        return cls(name, mm, nbytes, kind, owner=True)

    @classmethod
    def attach(cls, name: str, kind: int, timeout: float = 0.0) -> Segment:
        """Map an existing segment, waiting up to ``timeout`` seconds for its creator to make it."""
        path = segment_path(name)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise SegmentError(
                        f"segment {path} does not exist: start its creator first (or check run_id/rank)"
                    ) from None
                time.sleep(0.005)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise SegmentError(
                        f"segment {path} is a symbolic link, not a segment this run created: "
                        f"remove it (another user may have planted it)"
                    ) from None
                raise SegmentError(f"segment {path} cannot be opened ({e.strerror})") from None
        try:
            _check_owned(fd, path)
            total = os.fstat(fd).st_size
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        magic, got_kind, _, _, size = _PREFIX.unpack_from(mm, 0)
        if magic != MAGIC or got_kind != kind or size + PREFIX_BYTES != total:
            mm.close()
            raise SegmentError(
                f"segment {path} is not a StaleFlow segment of kind {kind} "
                f"(magic {magic!r}, kind {got_kind}): wrong name or corrupted file"
            )
        return cls(name, mm, size, kind, owner=False)

    @property
    def creator_pid(self) -> int:
        return _PREFIX.unpack_from(self._mm, 0)[2]

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Unmap (the file stays until its creator unlinks it). Tensors returned earlier were copies."""
        if self._mm is not None:
            self.u8 = None
            self.buf.release()
            try:
                self._mm.close()
            except BufferError:  # a view escaped: leave the mapping to the garbage collector
                pass
            self._mm = None

    def unlink(self) -> None:
        """Remove the file now (creator only); mapped pages live until every process unmaps."""
        if not self.owner:
            raise SegmentError(f"segment {self.name}: only its creator (pid {self.creator_pid}) may unlink it")
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer()


def list_segments(prefix: str = PREFIX) -> list[str]:
    """Names of the segments in SHM_DIR whose name starts with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def segment_owner(name: str) -> tuple[int, int] | None:
    """(creator pid, its start time; 0 = unknown) of a segment or leftover temp file, or None if the
    file is not one of ours (we never touch a file we cannot attribute)."""
    try:
        with open(segment_path(name), "rb") as f:
            head = f.read(_PREFIX.size)
    except OSError:
        return None
    if len(head) == _PREFIX.size and head[:8] == MAGIC:
        _, _, pid, start, _ = _PREFIX.unpack(head)
        return pid, start
    if ".tmp" in name and name.rsplit(".tmp", 1)[1].isdigit():
        return int(name.rsplit(".tmp", 1)[1]), 0
    return None


def cleanup_stale_segments(prefix: str = PREFIX) -> list[str]:
    """Remove segments (and leftover temp files) of runs whose creating process is dead.

    Segments of live processes are kept. Returns the removed names. Call it once at start-up,
    before creating this run's segments.
    """
    removed = []
    for name in list_segments(prefix):
        path = segment_path(name)
        owner = segment_owner(name)
        if owner is None:
            continue
        pid, start = owner
        if not pid_alive(pid, start):
            try:
                os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed
