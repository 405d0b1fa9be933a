"""Errors raised by the data-plane servers (Trajectory Server rings, Parameter Server slots).

Each message names the bad value and what to do. ``RingFull`` is not a failure: it is the
back-pressure signal of a Trajectory Server ring (free consumed records, then retry).
"""


class ServerError(RuntimeError):
    """Base class of every data-plane error."""


class SegmentError(ServerError):
    """A shared-memory segment is missing, foreign, or already exists."""


class RingFull(ServerError):
    """Back-pressure: the ring has no contiguous free space for this record right now."""


class RecordTooLarge(ServerError, ValueError):
    """A record can never fit in this ring, even when empty."""


class StaleHandle(ServerError):
    """A RecordHandle whose record was freed, overwritten, or belongs to another ring."""


class VersionNotFound(ServerError, LookupError):
    """A pulled weight version is not published, or was already overwritten."""


class TornRead(ServerError):
    """A slot changed while it was being copied, on every retry."""
