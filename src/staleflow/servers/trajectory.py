"""Trajectory Server data plane: one shared-memory ring of trajectory records per rollout rank.

The rollout rank is the single producer: it writes finished or interrupted (partial)
trajectories and sends the returned ``RecordHandle`` to the controller. The controller keeps
only handles (in its queues) and tells a trainer rank, or another rollout instance resuming
a partial trajectory, to ``read`` one. When a record is consumed or aborted the controller
sends "free" back to the producer, which alone owns the free-space bookkeeping
(``RingAllocator``). A full ring raises ``RingFull`` (back-pressure); nothing unconsumed is
ever overwritten.

Segment ``staleflow-<run_id>-ts-<rank>``: a 64-byte ring header, then the data region.
A record at a 64-aligned offset of the data region:

    header (64 B): state u32 (LIVE / FREED), flags u32, generation u64, length u64,
                   n_prompt u32, n_response u32, n_meta u32
    prompt_ids   int32   [n_prompt]      the four token sections are packed 4-byte words,
    response_ids int32   [n_response]    so a write is one torch.cat into the ring and a
    logprobs     float32 [n_response]    read one clone out of it (behaviour log-probs)
    versions     int32   [n_response]    weight version that generated each token
    meta         msgpack [n_meta]        optional (the runtime writes none: the ledger knows the rest)

Readers check state, generation and length before and after copying, so a stale handle
(freed or overwritten record) is an error, never garbage.

Usage::

    ring = TrajectoryRing.create(run_id, rank, nbytes=64 << 20)     # rollout rank
    handle = ring.write(TrajectoryRecord(prompt, response, logprobs, versions, meta))
    ring.free(handle)                                                # on the controller's word
    reader = TrajectoryRing.attach(run_id, rank)                     # trainer rank
    record = reader.read(handle)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from staleflow.servers.errors import RingFull, ServerError, StaleHandle
from staleflow.servers.ring import RECORD_ALIGN, RingAllocator, align_up
from staleflow.servers.segment import KIND_RING, Segment, check_run_id
from staleflow.trajectory import RecordHandle

RING_HEADER = struct.Struct("<8sIIQQ")  # magic, rank, reserved, capacity, generations written
RING_MAGIC = b"STLFRING"
RING_HEADER_BYTES = 64
REC_HEADER = struct.Struct("<IIQQIII")  # state, flags (0; reserved), generation, length, n_prompt, n_response, n_meta
REC_HEADER_BYTES = 64
LIVE, FREED = 0x4556494C, 0x44455246  # b"LIVE", b"FRED" little-endian
DEFAULT_RING_BYTES = 256 << 20
GENERATIONS_AT = 24  # ring header: generations written (a mirror: the newest generation received)


@dataclass
class TrajectoryRecord:
    """One trajectory (or the partial output of an interrupted one) with its behaviour data.

    ``logprobs`` and ``versions`` align with ``response_ids`` (one entry per generated token).
    Rewards are not stored here: the controller's ledger holds them.
    """

    prompt_ids: torch.Tensor | Sequence[int]  # [P] int32 (written from the engine's lists; read back as tensors)
    response_ids: torch.Tensor | Sequence[int]  # [R] int32
    logprobs: torch.Tensor | Sequence[float]  # [R] float32
    versions: torch.Tensor | Sequence[int]  # [R] int32
    meta: dict[str, Any] = field(default_factory=dict)


def ring_name(run_id: str, rank: int) -> str:
    return f"staleflow-{check_run_id(run_id)}-ts-{int(rank)}"


def _as_1d(x, dtype: torch.dtype, what: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype)
    if t.dtype == dtype and t.dim() == 1 and t.is_cpu:
        return t
    if t.dim() != 1:
        raise ValueError(f"TrajectoryRecord.{what} has shape {tuple(t.shape)}: must be 1-D")
    if t.dtype != dtype and (t.is_floating_point() != dtype.is_floating_point or t.is_complex()):
        raise ValueError(f"TrajectoryRecord.{what} has dtype {t.dtype}: need {dtype}")
    return t.to(device="cpu", dtype=dtype)


def _record_length(n_prompt: int, n_response: int, n_meta: int) -> int:
    """Bytes of a record: header, the token words, the metadata."""
    return REC_HEADER_BYTES + 4 * (n_prompt + 3 * n_response) + n_meta


def record_nbytes(n_prompt: int, n_response: int, meta_bytes: int = 64) -> int:
    """Bytes a record takes in a ring (for sizing rings): header + aligned sections, rounded to 64."""
    return align_up(_record_length(n_prompt, n_response, meta_bytes), RECORD_ALIGN)


class TrajectoryRing:
    """A rank's ring: ``create`` in the producer (write/free/read), ``attach`` in readers (read)."""

    def __init__(self, seg: Segment, rank: int, producer: bool):
        self.rank, self.producer, self._seg = rank, producer, seg
        magic, hdr_rank, _, capacity, _ = RING_HEADER.unpack_from(seg.buf, 0)
        if magic != RING_MAGIC or hdr_rank != rank:
            raise ServerError(f"segment {seg.name} is not the trajectory ring of rank {rank}")
        self.capacity = capacity
        self._words = seg.u8[RING_HEADER_BYTES : RING_HEADER_BYTES + capacity].view(torch.int32)  # [capacity/4]
        self._buf = seg.buf[RING_HEADER_BYTES : RING_HEADER_BYTES + capacity]
        self._alloc = RingAllocator(capacity) if producer else None
        self._generation = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def create(cls, run_id: str, rank: int, nbytes: int) -> TrajectoryRing:
        """Create the ring of rollout ``rank`` with a data region of ``nbytes`` (rounded up to 64)."""
        if nbytes < RECORD_ALIGN:
            raise ValueError(f"TrajectoryRing nbytes={nbytes} is invalid: need >= {RECORD_ALIGN}")
        capacity = align_up(nbytes)
        seg = Segment.create(ring_name(run_id, rank), RING_HEADER_BYTES + capacity, KIND_RING)
        RING_HEADER.pack_into(seg.buf, 0, RING_MAGIC, rank, 0, capacity, 0)
        return cls(seg, rank, producer=True)

    @classmethod
    def attach(cls, run_id: str, rank: int, timeout: float = 0.0) -> TrajectoryRing:
        """Attach as a reader, waiting up to ``timeout`` seconds for the producer to create the ring."""
        return cls(Segment.attach(ring_name(run_id, rank), KIND_RING, timeout), rank, producer=False)

    @property
    def name(self) -> str:
        return self._seg.name

    def close(self) -> None:
        """Unmap the ring. Records read earlier are copies and stay valid."""
        self._words = None
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        self._seg.close()

    def unlink(self) -> None:
        """Remove the segment (producer only; also done automatically at the producer's exit)."""
        self._seg.unlink()

    def __enter__(self) -> TrajectoryRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.producer:
            self.unlink()

    # -- producer -----------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._producer_only("used_bytes").used_bytes

    @property
    def generations_written(self) -> int:
        """The newest generation written (in a mirror ring: received from the producer's node)."""
        return struct.unpack_from("<Q", self._seg.buf, GENERATIONS_AT)[0]

    def record_view(self, handle: RecordHandle) -> memoryview:
        """The bytes of a live record, header included, as a view of the ring (no copy: what is
        shipped to another node). Valid until the record is freed (producer only)."""
        self._producer_only("record_view")
        self._check_handle(handle)
        state, _flags, gen, length = REC_HEADER.unpack_from(self._buf, handle.offset)[:4]
        self._check_header(handle, state, gen, length)
        return self._buf[handle.offset : handle.offset + length]

    @property
    def live_records(self) -> int:
        """Records not yet reclaimed (freed ones behind an older live record still count)."""
        return len(self._producer_only("live_records"))

    def write(self, record: TrajectoryRecord) -> RecordHandle:
        """Copy ``record`` into the ring. RingFull: no room now (free, retry); RecordTooLarge: never fits."""
        alloc = self._producer_only("write")
        prompt = _as_1d(record.prompt_ids, torch.int32, "prompt_ids")
        response = _as_1d(record.response_ids, torch.int32, "response_ids")
        logprobs = _as_1d(record.logprobs, torch.float32, "logprobs")
        versions = _as_1d(record.versions, torch.int32, "versions")
        n_resp = response.numel()
        if logprobs.numel() != n_resp or versions.numel() != n_resp:
            raise ValueError(
                f"TrajectoryRecord has {n_resp} response tokens but {logprobs.numel()} logprobs "
                f"and {versions.numel()} versions: need one of each per response token"
            )
        try:
            meta = self._encoder.encode(record.meta)
        except (TypeError, msgspec.EncodeError) as e:
            raise ValueError(
                f"TrajectoryRecord.meta cannot be encoded ({e}): use str/int/float/bool/list/dict values"
            ) from None
        n_words = prompt.numel() + 3 * n_resp
        length = _record_length(prompt.numel(), n_resp, len(meta))
        generation = self._generation + 1
        off = alloc.alloc(length, generation)
        if off is None:
            raise RingFull(
                f"ring {self.name}: no room for a {length}-byte record ({alloc.used_bytes} of "
                f"{self.capacity} bytes held by {len(alloc)} unconsumed records); free some and retry"
            )
        self._generation = generation
        w0 = (off + REC_HEADER_BYTES) // 4
        torch.cat([prompt, response, logprobs.view(torch.int32), versions], out=self._words[w0 : w0 + n_words])
        m0 = off + REC_HEADER_BYTES + 4 * n_words
        self._buf[m0 : m0 + len(meta)] = meta
        # Header last; the state word is the last field written, so a reader never sees LIVE early.
        REC_HEADER.pack_into(self._buf, off, FREED, 0, generation, length, prompt.numel(), n_resp, len(meta))
        struct.pack_into("<I", self._buf, off, LIVE)
        struct.pack_into("<Q", self._seg.buf, 24, generation)  # ring header: generations written
        return RecordHandle(self.rank, off, length, generation)

    def free(self, handle: RecordHandle) -> None:
        """Release a consumed or aborted record (controller's command); freeing twice is an error."""
        alloc = self._producer_only("free")
        self._check_handle(handle)
        if alloc.extent(handle.generation) is None:
            state, _, gen = REC_HEADER.unpack_from(self._buf, handle.offset)[:3]
            if state == FREED and gen == handle.generation:
                raise StaleHandle(f"record {handle} is already freed: free each handle exactly once")
        alloc.release(handle.generation, handle.offset)
        struct.pack_into("<I", self._buf, handle.offset, FREED)  # stale handles now fail to read

    # -- readers ------------------------------------------------------------------------------
    def read(self, handle: RecordHandle) -> TrajectoryRecord:
        """Copy the record of ``handle`` out of shared memory (one fresh CPU buffer; the four
        tensors of the returned record are views of it)."""
        self._check_handle(handle)
        off = handle.offset
        state, _flags, gen, length, n_p, n_r, n_m = REC_HEADER.unpack_from(self._buf, off)
        self._check_header(handle, state, gen, length)
        if _record_length(n_p, n_r, n_m) != length:
            raise StaleHandle(f"record {handle} has an inconsistent header (length {length})")
        w0 = (off + REC_HEADER_BYTES) // 4
        words = self._words[w0 : w0 + n_p + 3 * n_r].clone()  # one copy; the sections are views of it
        a, b, c = n_p, n_p + n_r, n_p + 2 * n_r
        prompt, response, logprobs, versions = words[:a], words[a:b], words[b:c], words[c:]
        m0 = off + REC_HEADER_BYTES + 4 * (n_p + 3 * n_r)
        meta = self._decoder.decode(self._buf[m0 : m0 + n_m]) if n_m else {}
        state2, _, gen2, length2 = REC_HEADER.unpack_from(self._buf, off)[:4]
        if (state2, gen2, length2) != (state, gen, length):
            raise StaleHandle(
                f"record {handle} was freed or overwritten while being read: the controller freed it "
                f"before this reader finished (read before sending 'consumed')"
            )
        return TrajectoryRecord(prompt, response, logprobs.view(torch.float32), versions, meta=meta)

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def decode(data, handle: RecordHandle) -> TrajectoryRecord:
        """A record from its bytes (``record_view`` of the producer, received over the network):
        the header must be LIVE and match ``handle``; the tensors share one fresh buffer."""
        buf = memoryview(data)
        if len(buf) != handle.length or handle.length < REC_HEADER_BYTES:
            raise StaleHandle(f"record {handle}: got {len(buf)} bytes")
        state, _flags, gen, length, n_p, n_r, n_m = REC_HEADER.unpack_from(buf, 0)
        if (
            state != LIVE
            or gen != handle.generation
            or length != handle.length
            or _record_length(n_p, n_r, n_m) != length
        ):
            raise StaleHandle(f"record {handle}: the bytes received are not that record (generation {gen})")
        words = (
            torch.frombuffer(
                bytearray(buf[REC_HEADER_BYTES : REC_HEADER_BYTES + 4 * (n_p + 3 * n_r)]), dtype=torch.int32
            )
            if n_p + n_r
            else torch.zeros(0, dtype=torch.int32)
        )
        a, b, c = n_p, n_p + n_r, n_p + 2 * n_r
        m0 = REC_HEADER_BYTES + 4 * (n_p + 3 * n_r)
        meta = msgspec.msgpack.decode(buf[m0 : m0 + n_m]) if n_m else {}
        return TrajectoryRecord(words[:a], words[a:b], words[b:c].view(torch.float32), words[c:], meta=meta)

    def _producer_only(self, what: str) -> RingAllocator:
        if not self.producer:
            raise ServerError(
                f"TrajectoryRing.{what} on ring {self.name}: only the producer (rollout rank "
                f"{self.rank}) may do this; readers only read"
            )
        return self._alloc

    def _check_handle(self, handle: RecordHandle) -> None:
        if not isinstance(handle, RecordHandle):
            raise TypeError(f"expected a RecordHandle, got {type(handle).__name__}")
        if handle.rank != self.rank:
            raise StaleHandle(f"handle {handle} belongs to the ring of rank {handle.rank}, not {self.rank}")
        if (
            handle.offset < 0
            or handle.offset % RECORD_ALIGN
            or handle.length < REC_HEADER_BYTES
            or handle.offset + handle.length > self.capacity
        ):
            raise StaleHandle(f"handle {handle} is out of bounds for ring {self.name} of {self.capacity} bytes")

    def _check_header(self, handle: RecordHandle, state: int, gen: int, length: int) -> None:
        if state != LIVE or gen != handle.generation or length != handle.length:
            why = "was freed" if state == FREED and gen == handle.generation else "was overwritten or never written"
            raise StaleHandle(
                f"record {handle} {why} (ring {self.name} holds generation {gen} there): "
                f"do not use a handle after the controller freed it"
            )
