"""Plain data of the staleness protocol: entry and buffer states, the per-buffer and per-group
records the manager keeps, and its error type (shared by staleness.py and state.py)."""

from __future__ import annotations

import enum


class ProtocolError(ValueError):
    """Misuse of the staleness protocol (unknown id, inadmissible version, out-of-order consume)."""


class EntryState(str, enum.Enum):
    EMPTY = "empty"
    RESERVED = "reserved"
    OCCUPIED = "occupied"


class BufferState(str, enum.Enum):
    WAITING = "waiting"  # has EMPTY entries, still accepts reservations
    READY = "ready"  # batch_size entries OCCUPIED: the trainer may consume it
    STUCK = "stuck"  # no EMPTY entry, not Ready: waits on in-flight reservations


class _Buffer:
    __slots__ = ("reserved", "occupied")

    def __init__(self):
        self.reserved: dict = {}  # group_id -> None (ordered set of RESERVED entries)
        self.occupied: list = []  # group ids of OCCUPIED entries, in occupation order


class _Group:
    __slots__ = ("group_id", "traj_version", "buffer", "occupied", "live", "done")

    def __init__(self, group_id, traj_version: int, buffer: int | None = None, live: dict | None = None):
        self.group_id = group_id
        self.traj_version = traj_version  # min V_traj over members
        self.buffer = buffer  # reserved (or occupied) buffer version; None = closed
        self.occupied = False
        self.live: dict = {} if live is None else live  # traj_id -> V_traj, still generating
        self.done: dict = {}  # traj_id -> V_traj, finished generation


_FAST_ID = (int, str)


def _check_id(kind: str, value) -> None:
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        raise ProtocolError(f"{kind} {value!r} must be an int or str (JSON-able), got {type(value).__name__}")
