"""One Parameter Server slot as a process sees it: its header in the slot segment, a lock, and the
views of the pieces this process mapped. The header layout and the state machine are documented
in parameter.py."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import torch

from staleflow.servers.errors import TornRead, VersionNotFound
from staleflow.servers.pieces import Piece
from staleflow.servers.segment import Segment, check_run_id, segment_path

# magic, slot, state, version, stamp, data offset, layout length, pieces, reader handles, node, piece table length
SLOT_HEADER = struct.Struct("<8sIIqQQIIIII")
SLOT_MAGIC = b"STLFSLOT"
EMPTY, FILLING, PUBLISHED = 0, 1, 2
_STATE, _VERSION, _STAMP = 12, 16, 24  # byte offsets of the mutable header fields
NUM_SLOTS = 2


def slot_name(run_id: str, slot: int, node: int = 0) -> str:
    """The slot segment of ``node`` (node 0 keeps the single-node name; two agents on one machine are
    two nodes sharing one /dev/shm, so the others' names carry their node)."""
    return f"staleflow-{check_run_id(run_id)}-ps-{slot}" + (f"-n{int(node)}" if node else "")


class _Slot:
    """One slot: its segment, a lock fd, and the typed views of every piece mapped here
    (``views[p]`` is None for a GPU piece this process did not map)."""

    def __init__(
        self, seg: Segment, slot: int, views: list[dict[str, torch.Tensor] | None], pieces: list[Piece | None] = ()
    ):
        self.seg, self.slot, self.views, self.pieces = seg, slot, views, list(pieces)
        self.lock_fd = os.open(segment_path(seg.name), os.O_RDWR | os.O_NOFOLLOW)

    def header(self) -> tuple[int, int, int]:
        """(state, version, stamp)."""
        return (
            struct.unpack_from("<I", self.seg.buf, _STATE)[0],
            struct.unpack_from("<q", self.seg.buf, _VERSION)[0],
            struct.unpack_from("<Q", self.seg.buf, _STAMP)[0],
        )

    def set(self, state: int | None = None, version: int | None = None, bump: bool = False) -> None:
        if bump:
            struct.pack_into("<Q", self.seg.buf, _STAMP, struct.unpack_from("<Q", self.seg.buf, _STAMP)[0] + 1)
        if version is not None:
            struct.pack_into("<q", self.seg.buf, _VERSION, version)
        if state is not None:
            struct.pack_into("<I", self.seg.buf, _STATE, state)

    def close(self) -> None:
        self.views = []
        for p in self.pieces:
            if p is not None:
                p.close()
        self.pieces = []
        os.close(self.lock_fd)
        self.seg.close()


def read_clean(
    read: Callable[[int], bool | None],
    version: Callable[[], int | None],
    attempts: int,
    what: str,
    follow_newest: bool = True,
) -> int:
    """The one retry loop of every weight reader (local slots, another node's owners, a vLLM
    worker): ``read(v)`` copies version v and returns True when the copy is clean (the seqlock
    stamp did not move), False when it was torn, None when v is no longer there (overwritten).

    ``version()`` says what to read now: the newest published version (``follow_newest``: a torn
    or overwritten copy is retried with whatever is newest then), or one fixed version (then
    "overwritten" is final: VersionNotFound). Returns the version read; TornRead after
    ``attempts`` unclean copies. ``read`` may also raise TornRead / VersionNotFound to mean
    False / None (a stream that notices the change on leaving)."""
    for _ in range(attempts):
        v = version()
        if v is None:
            raise VersionNotFound(f"{what}: no version has been published yet; wait for the first push")
        try:
            clean = read(v)
        except TornRead:
            clean = False
        except VersionNotFound:
            clean = None
        if clean:
            return v
        if clean is None and not follow_newest:
            raise VersionNotFound(f"{what}: version {v} is not available any more (overwritten); pull the newest")
    raise TornRead(
        f"{what}: the slot changed during each of {attempts} copies (a writer bypassing the slot "
        f"lock, or versions published faster than they can be read)"
    )
