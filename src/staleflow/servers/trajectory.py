"""Trajectory Server data plane: one shared-memory ring of trajectory records per rollout rank.

The rollout rank is the single producer: it writes finished or interrupted (partial)
trajectories and sends the returned ``RecordHandle`` to the controller. The controller keeps
only handles (in its queues) and tells a trainer rank, or another rollout instance resuming
a partial trajectory, to ``read`` one. When a record is consumed or aborted the controller
sends "free" back to the producer, which alone owns the free-space bookkeeping
(``RingAllocator``). A full ring raises ``RingFull`` (back-pressure); nothing unconsumed is
ever overwritten.

Segment ``staleflow-<run_id>-ts-<rank>``: a 64-byte ring header, then the data region.
A record is one trajectory's token payload (``TrajectoryTokens``, staleflow/trajectory.py), at a
64-aligned offset of the data region:

    header (64 B): state u32 (LIVE / FREED), flags u32 (bit 0: MASKED), generation u64,
                   length u64, n_prompt u32, n_response u32, reserved u32 (0)
    prompt_ids         int32   [n_prompt]     the sections are packed 4-byte words, so a write
    response_ids       int32   [n_response]   is one torch.cat into the ring and a read one
    behaviour_logprobs float32 [n_response]   clone out of it
    versions           int32   [n_response]   weight version that sampled each token
    loss_mask          int32   [n_response]   only when MASKED (environment tokens, 0); absent for
                                              an all-ones mask, which reads back as None

Readers check state, generation and length before and after copying, so a stale handle
(freed or overwritten record) is an error, never garbage.

Usage::

    ring = TrajectoryRing.create(run_id, rank, nbytes=64 << 20)     # rollout rank
    handle = ring.write(TrajectoryTokens(prompt, response, logprobs, versions))
    ring.free(handle)                                                # on the controller's word
    reader = TrajectoryRing.attach(run_id, rank)                     # trainer rank
    tokens = reader.read(handle)                                     # TrajectoryTokens of tensors
"""

from __future__ import annotations

import struct

import torch

from staleflow.servers.errors import RingFull, ServerError, StaleHandle
from staleflow.servers.ring import RECORD_ALIGN, RingAllocator, align_up
from staleflow.servers.segment import KIND_RING, Segment, check_run_id
from staleflow.trajectory import RecordHandle, TrajectoryTokens

RING_HEADER = struct.Struct("<8sIIQQ")  # magic, rank, reserved, capacity, generations written
RING_MAGIC = b"STLFRING"
RING_HEADER_BYTES = 64
REC_HEADER = struct.Struct("<IIQQIII")  # state, flags, generation, length, n_prompt, n_response, reserved (0)
REC_HEADER_BYTES = 64
LIVE, FREED = 0x4556494C, 0x44455246  # b"LIVE", b"FRED" little-endian
MASKED = 1
"""Record flag: a loss_mask section follows the versions (a trajectory with environment tokens)."""
DEFAULT_RING_BYTES = 256 << 20
GENERATIONS_AT = 24  # ring header: generations written (a mirror: the newest generation received)


def ring_name(run_id: str, rank: int) -> str:
    return f"staleflow-{check_run_id(run_id)}-ts-{int(rank)}"


def _as_1d(x, dtype: torch.dtype, what: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype)
    if t.dtype == dtype and t.dim() == 1 and t.is_cpu:
        return t
    if t.dim() != 1:
        raise ValueError(f"TrajectoryTokens.{what} has shape {tuple(t.shape)}: must be 1-D")
    if t.dtype != dtype and (t.is_floating_point() != dtype.is_floating_point or t.is_complex()):
        raise ValueError(f"TrajectoryTokens.{what} has dtype {t.dtype}: need {dtype}")
    return t.to(device="cpu", dtype=dtype)


def _sections(n_prompt: int, n_response: int, flags: int) -> int:
    """4-byte words of a record's token sections."""
    return n_prompt + (4 if flags & MASKED else 3) * n_response


def _record_length(n_prompt: int, n_response: int, flags: int) -> int:
    """Bytes of a record: header and the token words."""
    return REC_HEADER_BYTES + 4 * _sections(n_prompt, n_response, flags)


def record_nbytes(n_prompt: int, n_response: int, masked: bool = False) -> int:
    """Bytes a record takes in a ring (for sizing rings): header + sections, rounded to 64."""
    return align_up(_record_length(n_prompt, n_response, MASKED if masked else 0), RECORD_ALIGN)


def _tokens_of(words: torch.Tensor, n_p: int, n_r: int, flags: int) -> TrajectoryTokens:
    """The payload whose sections are views of ``words`` (one fresh buffer)."""
    a, b, c, d = n_p, n_p + n_r, n_p + 2 * n_r, n_p + 3 * n_r
    mask = words[d : d + n_r] if flags & MASKED else None
    return TrajectoryTokens(words[:a], words[a:b], words[b:c].view(torch.float32), words[c:d], mask)


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

    def write(self, tokens: TrajectoryTokens) -> RecordHandle:
        """Copy ``tokens`` into the ring. RingFull: no room now (free, retry); RecordTooLarge: never fits.
        An all-ones loss mask is stored as none (it reads back as None)."""
        alloc = self._producer_only("write")
        prompt = _as_1d(tokens.prompt_ids, torch.int32, "prompt_ids")
        response = _as_1d(tokens.response_ids, torch.int32, "response_ids")
        logprobs = _as_1d(tokens.behaviour_logprobs, torch.float32, "behaviour_logprobs")
        versions = _as_1d(tokens.versions, torch.int32, "versions")
        mask = None if tokens.loss_mask is None else _as_1d(tokens.loss_mask, torch.int32, "loss_mask")
        n_resp = response.numel()
        if logprobs.numel() != n_resp or versions.numel() != n_resp or (mask is not None and mask.numel() != n_resp):
            raise ValueError(
                f"TrajectoryTokens has {n_resp} response tokens but {logprobs.numel()} behaviour_logprobs, "
                f"{versions.numel()} versions and {'no' if mask is None else mask.numel()} loss_mask entries: "
                "need one of each per response token"
            )
        if mask is not None and bool((mask == 1).all()):
            mask = None
        flags = 0 if mask is None else MASKED
        n_words = _sections(prompt.numel(), n_resp, flags)
        length = _record_length(prompt.numel(), n_resp, flags)
        generation = self._generation + 1
        off = alloc.alloc(length, generation)
        if off is None:
            raise RingFull(
                f"ring {self.name}: no room for a {length}-byte record ({alloc.used_bytes} of "
                f"{self.capacity} bytes held by {len(alloc)} unconsumed records); free some and retry"
            )
        self._generation = generation
        w0 = (off + REC_HEADER_BYTES) // 4
        parts = [prompt, response, logprobs.view(torch.int32), versions] + ([] if mask is None else [mask])
        torch.cat(parts, out=self._words[w0 : w0 + n_words])
        # Header last; the state word is the last field written, so a reader never sees LIVE early.
        REC_HEADER.pack_into(self._buf, off, FREED, flags, generation, length, prompt.numel(), n_resp, 0)
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
    def read(self, handle: RecordHandle) -> TrajectoryTokens:
        """Copy the record of ``handle`` out of shared memory (one fresh CPU buffer; the tensors of
        the returned payload are views of it)."""
        self._check_handle(handle)
        off = handle.offset
        state, flags, gen, length, n_p, n_r, _ = REC_HEADER.unpack_from(self._buf, off)
        self._check_header(handle, state, gen, length)
        if _record_length(n_p, n_r, flags) != length:
            raise StaleHandle(f"record {handle} has an inconsistent header (length {length})")
        w0 = (off + REC_HEADER_BYTES) // 4
        words = self._words[w0 : w0 + _sections(n_p, n_r, flags)].clone()  # one copy; the sections are views of it
        state2, _, gen2, length2 = REC_HEADER.unpack_from(self._buf, off)[:4]
        if (state2, gen2, length2) != (state, gen, length):
            raise StaleHandle(
                f"record {handle} was freed or overwritten while being read: the controller freed it "
                f"before this reader finished (read before sending 'consumed')"
            )
        return _tokens_of(words, n_p, n_r, flags)

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def decode(data, handle: RecordHandle) -> TrajectoryTokens:
        """A record from its bytes (``record_view`` of the producer, received over the network):
        the header must be LIVE and match ``handle``; the tensors share one fresh buffer."""
        buf = memoryview(data)
        if len(buf) != handle.length or handle.length < REC_HEADER_BYTES:
            raise StaleHandle(f"record {handle}: got {len(buf)} bytes")
        state, flags, gen, length, n_p, n_r, _ = REC_HEADER.unpack_from(buf, 0)
        if (
            state != LIVE
            or gen != handle.generation
            or length != handle.length
            or _record_length(n_p, n_r, flags) != length
        ):
            raise StaleHandle(f"record {handle}: the bytes received are not that record (generation {gen})")
        n_words = _sections(n_p, n_r, flags)
        words = (
            torch.frombuffer(bytearray(buf[REC_HEADER_BYTES : REC_HEADER_BYTES + 4 * n_words]), dtype=torch.int32)
            if n_words
            else torch.zeros(0, dtype=torch.int32)
        )
        return _tokens_of(words, n_p, n_r, flags)

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
