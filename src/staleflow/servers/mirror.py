"""Mirror rings: a node's copy of the trajectory records other nodes shipped to it.

A rollout rank on a node without trainer ranks ships each finished record (its bytes, header
included) to the record receiver of every trainer node (servers/shipping.py). The receiver writes
it into that node's mirror of the producer's ring **at the producer's offset**, so the record's
``RecordHandle`` is valid in both, and readers on the trainer node read the mirror with the ring's
own code (``TrajectoryRing``: state, generation and length checked before and after the copy).
The mirror's space needs no allocator of its own: the producer's allocator decides every offset,
and because a record's free is shipped (on the same connection, so after the record) before the
producer can reuse its space, the mirror never holds two live records that overlap.

    mirror = MirrorRing(run_id, rank=2, node=0, capacity=ring.capacity)   # the receiver, node 0
    mirror.write(handle, payload); mirror.free(handle)
    reader = attach_mirror(run_id, rank=2, node=0, timeout=30)            # trainer ranks, controller
    rec = read_arrived(reader, handle, timeout=60)                          # waits for the bytes

Segment ``staleflow-<run_id>-tsm-<rank>-<node>``: the ring's header (its generations word holds
the newest generation received), then the data region. A record is written data first and its
state word last, like the producer's own writes; the generations word is raised after the record,
so a reader that sees it at or above its handle's generation finds the record complete (or gone).
"""

from __future__ import annotations

import struct
import time

from staleflow.servers.errors import ServerError, StaleHandle
from staleflow.servers.ring import RECORD_ALIGN
from staleflow.servers.segment import KIND_RING, Segment, check_run_id
from staleflow.servers.trajectory import (
    FREED,
    GENERATIONS_AT,
    LIVE,
    REC_HEADER,
    REC_HEADER_BYTES,
    RING_HEADER,
    RING_HEADER_BYTES,
    RING_MAGIC,
    TrajectoryRing,
)
from staleflow.trajectory import RecordHandle, TrajectoryTokens


class RecordLate(ServerError, TimeoutError):
    """A record announced by its producer did not arrive in this node's mirror in time."""


def mirror_name(run_id: str, rank: int, node: int) -> str:
    return f"staleflow-{check_run_id(run_id)}-tsm-{int(rank)}-{int(node)}"


class MirrorRing:
    """The writer of one mirror (the node's record receiver); readers use ``attach_mirror``."""

    def __init__(self, run_id: str, rank: int, node: int, capacity: int):
        if capacity <= 0 or capacity % RECORD_ALIGN:
            raise ValueError(f"mirror capacity {capacity} is invalid: a positive multiple of {RECORD_ALIGN}")

        def init(buf: memoryview) -> None:
            RING_HEADER.pack_into(buf, 0, RING_MAGIC, rank, 0, capacity, 0)

        self.rank, self.capacity = rank, capacity
        self._seg = Segment.create(mirror_name(run_id, rank, node), RING_HEADER_BYTES + capacity, KIND_RING, init=init)
        self._buf = self._seg.buf[RING_HEADER_BYTES : RING_HEADER_BYTES + capacity]
        self.records = 0
        self.bytes = 0

    @property
    def name(self) -> str:
        return self._seg.name

    def write(self, handle: RecordHandle, payload: memoryview) -> None:
        """Store a shipped record at its offset. Raises ServerError for bytes that are not the
        record ``handle`` names (the caller logs and drops them)."""
        off, length = handle.offset, handle.length
        if (
            handle.rank != self.rank
            or off < 0
            or off % RECORD_ALIGN
            or length < REC_HEADER_BYTES
            or off + length > self.capacity
            or len(payload) != length
        ):
            raise ServerError(
                f"shipped record {handle} ({len(payload)} bytes) does not fit mirror {self.name} "
                f"of {self.capacity} bytes"
            )
        state, _, gen, got_len = REC_HEADER.unpack_from(payload, 0)[:4]
        if state != LIVE or gen != handle.generation or got_len != length:
            raise ServerError(f"shipped record {handle}: its header says generation {gen}, length {got_len}")
        struct.pack_into("<I", self._buf, off, FREED)  # nobody reads the old bytes as this record meanwhile
        self._buf[off + 4 : off + length] = payload[4:]
        self._buf[off : off + 4] = payload[:4]  # the state word last: LIVE
        if gen > struct.unpack_from("<Q", self._seg.buf, GENERATIONS_AT)[0]:
            struct.pack_into("<Q", self._seg.buf, GENERATIONS_AT, gen)
        self.records += 1
        self.bytes += length

    def free(self, handle: RecordHandle) -> bool:
        """Mark a shipped record freed (its producer freed it); False if the mirror does not hold it."""
        if handle.offset < 0 or handle.offset % RECORD_ALIGN or handle.offset + REC_HEADER_BYTES > self.capacity:
            return False
        state, _, gen = REC_HEADER.unpack_from(self._buf, handle.offset)[:3]
        if state != LIVE or gen != handle.generation:
            return False
        struct.pack_into("<I", self._buf, handle.offset, FREED)
        return True

    def close(self) -> None:
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        self._seg.close()
        self._seg.unlink()


def attach_mirror(run_id: str, rank: int, node: int, timeout: float = 0.0) -> TrajectoryRing:
    """A reader of node ``node``'s mirror of rank ``rank``'s ring (waits for the receiver to make it)."""
    return TrajectoryRing(Segment.attach(mirror_name(run_id, rank, node), KIND_RING, timeout), rank, producer=False)


def arrived(ring: TrajectoryRing, handle: RecordHandle) -> bool:
    """Whether the mirror has received the record of ``handle`` (or anything newer)."""
    return ring.generations_written >= handle.generation


def read_arrived(ring: TrajectoryRing, handle: RecordHandle, timeout: float = 60.0) -> TrajectoryTokens:
    """Read a record from a mirror once it has arrived (StaleHandle if it was freed meanwhile)."""
    deadline = time.monotonic() + timeout
    pause = 0.0002
    while not arrived(ring, handle):
        if time.monotonic() > deadline:
            raise RecordLate(
                f"record {handle} of rank {handle.rank} did not reach this node within {timeout:.0f} s "
                f"(newest received: generation {ring.generations_written}): is the network between the "
                f"nodes up, and the record receiver (the node's first trainer rank) alive?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    return ring.read(handle)


__all__ = ["MirrorRing", "RecordLate", "StaleHandle", "arrived", "attach_mirror", "mirror_name", "read_arrived"]
