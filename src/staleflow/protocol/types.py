"""Plain data of the batch protocols: the staleness settings (``StalenessSpec``), entry and buffer
states, the per-group record every protocol keeps, and the error type."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ProtocolError(ValueError):
    """Misuse of the staleness protocol (unknown id, inadmissible version, out-of-order consume)."""


@dataclass(frozen=True)
class StalenessSpec:
    """What every batch protocol is built from: the bound eta, B and B' (``capacity``), N and N'
    (``group_capacity``) and the version a run starts at (> 0 on resume). Validated here once.

    >>> StalenessSpec(eta=1, batch_size=4, group_size=2).group_capacity
    2
    """

    eta: int
    batch_size: int
    capacity: int | None = None
    """B' >= B: groups admitted per buffer (None: B)."""
    group_size: int = 1
    group_capacity: int | None = None
    """N' >= N: members generated per group (None: N)."""
    version: int = 0

    def __post_init__(self):
        if self.capacity is None:
            object.__setattr__(self, "capacity", self.batch_size)
        if self.group_capacity is None:
            object.__setattr__(self, "group_capacity", self.group_size)
        for name, low in (
            ("eta", 0),
            ("batch_size", 1),
            ("capacity", self.batch_size),
            ("group_size", 1),
            ("group_capacity", self.group_size),
            ("version", 0),
        ):
            val = getattr(self, name)
            if type(val) is not int or val < low:
                raise ProtocolError(f"staleness {name}={val!r} is invalid: must be an int >= {low!r}")


class EntryState(str, enum.Enum):
    EMPTY = "empty"
    RESERVED = "reserved"
    OCCUPIED = "occupied"


class BufferState(str, enum.Enum):
    WAITING = "waiting"  # has EMPTY entries, still accepts reservations
    READY = "ready"  # batch_size entries OCCUPIED: the trainer may consume it
    STUCK = "stuck"  # no EMPTY entry, not Ready: waits on in-flight reservations


class _Group:
    """One prompt group's reservation: its window (min V_traj over members), where it sits, and which
    member ids hold it. Facts about the trajectories themselves (tokens, rewards, each member's own
    V_traj, fate) are the controller ledger's; the protocol names members by id only."""

    __slots__ = ("group_id", "traj_version", "buffer", "occupied", "live", "done")

    def __init__(self, group_id, traj_version: int, buffer: int | None = None, first=None):
        self.group_id = group_id
        self.traj_version = traj_version  # min V_traj over members: the group's window starts here
        self.buffer = buffer  # reserved (or occupied) buffer version; None = closed
        self.occupied = False
        self.live: dict = {} if first is None else {first: None}  # ids still generating (ordered set)
        self.done: dict = {}  # ids that finished generation (ordered set)

    def info(self, state: str) -> dict:
        """What ``group_info`` reports (both protocols): the group's window, place, ``state`` and members."""
        return {
            "group_id": self.group_id,
            "traj_version": self.traj_version,
            "buffer_version": self.buffer,
            "state": state,
            "live": list(self.live),
            "done": list(self.done),
        }


_FAST_ID = (int, str)


def _check_id(kind: str, value) -> None:
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        raise ProtocolError(f"{kind} {value!r} must be an int or str (JSON-able), got {type(value).__name__}")
