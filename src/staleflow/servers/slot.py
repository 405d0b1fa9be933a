"""One Parameter Server slot as a process sees it: its header in the slot segment, a lock, and the
views of the pieces this process mapped. The header layout and the state machine are documented
in parameter.py."""

from __future__ import annotations

import os
import struct

import torch

from staleflow.servers.pieces import Piece
from staleflow.servers.segment import Segment, check_run_id, segment_path

# magic, slot, state, version, stamp, data offset, layout length, pieces, reader handles
SLOT_HEADER = struct.Struct("<8sIIqQQIII")
SLOT_MAGIC = b"STLFSLOT"
EMPTY, FILLING, PUBLISHED = 0, 1, 2
_STATE, _VERSION, _STAMP = 12, 16, 24  # byte offsets of the mutable header fields
NUM_SLOTS = 2


def slot_name(run_id: str, slot: int) -> str:
    return f"staleflow-{check_run_id(run_id)}-ps-{slot}"


class _Slot:
    """One slot: its segment, a lock fd, and the typed views of every piece mapped here
    (``views[p]`` is None for a GPU piece this process did not map)."""

    def __init__(self, seg: Segment, slot: int, views: list[dict[str, torch.Tensor] | None],
                 pieces: list[Piece | None] = ()):
        self.seg, self.slot, self.views, self.pieces = seg, slot, views, list(pieces)
        self.lock_fd = os.open(segment_path(seg.name), os.O_RDWR | os.O_NOFOLLOW)

    def header(self) -> tuple[int, int, int]:
        """(state, version, stamp)."""
        return (struct.unpack_from("<I", self.seg.buf, _STATE)[0], struct.unpack_from("<q", self.seg.buf, _VERSION)[0],
                struct.unpack_from("<Q", self.seg.buf, _STAMP)[0])

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


