"""Trajectory records across nodes: shipping finished records, fetching partial ones.

Two paths, both over CURVE TCP sockets (net/curve.py), both sending straight from the producer's
shared-memory ring (zero-copy: libzmq reads the ring; Python copies nothing):

- **Shipping** (``RecordShipper`` -> ``RecordReceiver``): a rollout rank whose node has no trainer
  rank pushes every finished record to the receiver of each trainer node as soon as it is written,
  before its Finished, overlapped with generation. The receiver (a thread of the node's first
  trainer rank) writes it into the node's mirror of that ring at the same offset (servers/mirror.py).
  Frees follow the same connection: after the controller's FreeRecords the producer frees its ring
  and ships the free, so the mirror marks it freed too. Exactly once: the controller frees each
  handle once, the producer refuses a second free, and a mirror frees only the generation it holds.
- **Fetching** (``RecordFetcher`` -> ``RecordServer``): a partial (interrupted) record that resumes
  on a rollout rank of another node is requested from its producer, which answers from its ring
  between engine steps. Rare (a loop-back migrating across nodes), so on demand.

A zero-copy send reads the ring until libzmq is done with it, so a record's ring space must not be
reused before: ``ZeroCopySends.wait(handle)`` is called before every ``ring.free``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from staleflow.net.curve import incoming, user_rank
from staleflow.servers.errors import ServerError, StaleHandle
from staleflow.servers.mirror import MirrorRing
from staleflow.servers.trajectory import TrajectoryRing
from staleflow.trajectory import RecordHandle, TrajectoryTokens


class Shipped(msgspec.Struct, tag=True, array_like=True):
    """Header frame of a shipped record; the next frame is its bytes."""

    handle: RecordHandle
    capacity: int


class Freed(msgspec.Struct, tag=True, array_like=True):
    handles: list[RecordHandle]


class Fetch(msgspec.Struct, tag=True, array_like=True):
    handle: RecordHandle


class Fetched(msgspec.Struct, tag=True, array_like=True):
    """Reply to a Fetch; ok: the next frame is the record's bytes."""

    handle: RecordHandle
    ok: bool
    error: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Shipped | Freed | Fetch | Fetched).decode


def _say(text: str) -> None:
    print(f"staleflow: {text}", file=sys.stderr, flush=True)


class ZeroCopySends:
    """The zero-copy sends still reading each record's ring bytes, by generation."""

    def __init__(self):
        self._inflight: dict[int, list[zmq.MessageTracker]] = {}

    def add(self, handle: RecordHandle, tracker: zmq.MessageTracker) -> None:
        if not tracker.done:
            self._inflight.setdefault(handle.generation, []).append(tracker)

    def wait(self, handle: RecordHandle, timeout: float = 60.0) -> None:
        """Before the producer frees ``handle``: every send of its bytes has left the ring."""
        for t in self._inflight.pop(handle.generation, ()):
            try:
                t.wait(timeout)
            except zmq.NotDone:
                raise ServerError(
                    f"record {handle} is still being sent to another node after {timeout:.0f} s: the "
                    f"network between the nodes is stuck"
                ) from None

    def wait_all(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for trackers in self._inflight.values():
            for t in trackers:
                try:
                    t.wait(max(0.0, deadline - time.monotonic()))
                except zmq.NotDone:
                    pass
        self._inflight.clear()


class RecordShipper:
    """Producer side (a rollout rank): finished records and their frees to every trainer node."""

    def __init__(self, socks: dict[int, zmq.Socket], sends: ZeroCopySends):
        self.socks, self.sends = socks, sends  # node -> PUSH socket connected to its receiver
        self._shipped: set[int] = set()

    def ship(self, ring: TrajectoryRing, handle: RecordHandle) -> tuple[int, int]:
        """Send the record to every trainer node; returns (copies, bytes) sent across nodes."""
        view = ring.record_view(handle)
        head = _encode(Shipped(handle, ring.capacity))
        for sock in self.socks.values():
            self.sends.add(handle, sock.send_multipart([head, view], copy=False, track=True))
        self._shipped.add(handle.generation)
        return len(self.socks), len(self.socks) * handle.length

    def freed(self, handles: list[RecordHandle]) -> None:
        """The producer freed these (after ``sends.wait``): the mirrors free their copies too."""
        hs = [h for h in handles if h.generation in self._shipped]
        if not hs:
            return
        self._shipped.difference_update(h.generation for h in hs)
        data = _encode(Freed(hs))
        for sock in self.socks.values():
            sock.send(data)

    def close(self) -> None:
        self.sends.wait_all()
        for sock in self.socks.values():
            sock.close(linger=1000)


class RecordReceiver:
    """A trainer node's receiver (a thread of its first trainer rank): shipped records into mirrors.

    Only run members reach it (CURVE); a rank may only write its own ring's mirror. Anything
    malformed is logged and dropped; the thread never dies of its input."""

    def __init__(self, sock: zmq.Socket, run_id: str, node: int, ranks: list[int], capacity: int):
        self.sock = sock
        self.mirrors = {r: MirrorRing(run_id, r, node, capacity) for r in ranks}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="staleflow-records", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for frames in incoming(self.sock, self._stop):
            try:
                self.handle(frames)
            except (ServerError, msgspec.MsgspecError, ValueError, TypeError) as e:
                self.errors += 1
                _say(f"record receiver: dropped a message ({str(e)[:200]})")

    def handle(self, frames: list) -> None:
        who = user_rank(frames[0])
        msg = _decode(frames[0].bytes)
        if isinstance(msg, Shipped):
            h = msg.handle
            mirror = self.mirrors.get(h.rank)
            if mirror is None or who != h.rank or len(frames) != 2 or msg.capacity != mirror.capacity:
                raise ServerError(
                    f"a record for ring {h.rank} from rank {who} (capacity {msg.capacity}): not one "
                    f"this node mirrors, or not the sender's own ring"
                )
            mirror.write(h, frames[1].buffer)
        elif isinstance(msg, Freed):
            for h in msg.handles:
                mirror = self.mirrors.get(h.rank)
                if mirror is None or who != h.rank:
                    raise ServerError(f"rank {who} freed a record of ring {h.rank}")
                if not mirror.free(h):
                    raise ServerError(f"free of {h}, which this node's mirror does not hold")
        else:
            raise ServerError(f"unexpected {type(msg).__name__} on the record receiver")

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
        for m in self.mirrors.values():
            m.close()


class RecordServer:
    """A rollout rank's answers to Fetch requests for records of its ring (served between steps)."""

    def __init__(self, sock: zmq.Socket, sends: ZeroCopySends):
        self.sock, self.sends = sock, sends
        self.served = 0

    def serve(self, ring: TrajectoryRing) -> None:
        """Answer every request already queued (never blocks)."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                if len(frames) != 2 or user_rank(frames[1]) is None:
                    raise ServerError(f"{len(frames)} frames from an unauthenticated peer")
                msg = _decode(frames[1].bytes)
                if not isinstance(msg, Fetch):
                    raise ServerError(f"unexpected {type(msg).__name__}")
            except (ServerError, msgspec.MsgspecError, ValueError) as e:
                _say(f"record server: dropped a request ({str(e)[:200]})")
                continue
            ident, h = frames[0].bytes, msg.handle
            try:
                view = ring.record_view(h)
            except (StaleHandle, ServerError) as e:  # freed meanwhile (an Abort crossed the route)
                self.sock.send_multipart([ident, _encode(Fetched(h, False, str(e)[:300]))])
                continue
            self.sends.add(
                h, self.sock.send_multipart([ident, _encode(Fetched(h, True)), view], copy=False, track=True)
            )
            self.served += 1

    def close(self) -> None:
        self.sock.close(linger=1000)


class RecordFetcher:
    """Fetch partial records from the rollout ranks of other nodes (one DEALER per producer)."""

    def __init__(self, connect: Callable[[int], zmq.Socket]):
        self._connect = connect  # producer rank -> a CURVE DEALER connected to its RecordServer
        self._socks: dict[int, zmq.Socket] = {}
        self.records = 0
        self.bytes = 0

    def fetch(
        self, handles: list[RecordHandle], serve: Callable[[], None] = lambda: None, timeout: float = 60.0
    ) -> dict[RecordHandle, TrajectoryTokens | None]:
        """Records of ``handles`` (None: freed by their producer meanwhile). ``serve`` runs while
        waiting, so two ranks fetching from each other never wait on each other."""
        for h in handles:
            if h.rank not in self._socks:
                self._socks[h.rank] = self._connect(h.rank)
            self._socks[h.rank].send(_encode(Fetch(h)))
        out: dict[RecordHandle, TrajectoryTokens | None] = {}
        poller = zmq.Poller()
        for r in {h.rank for h in handles}:
            poller.register(self._socks[r], zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while len(out) < len(set(handles)):
            if time.monotonic() > deadline:
                missing = [h for h in handles if h not in out]
                raise ServerError(
                    f"no answer within {timeout:.0f} s for records {missing[:3]} from rollout ranks "
                    f"{sorted({h.rank for h in missing})} on another node: is that rank alive?"
                )
            for sock, _ in poller.poll(10):
                frames = sock.recv_multipart(copy=False)
                reply = _decode(frames[0].bytes)
                if not isinstance(reply, Fetched) or reply.handle not in handles:
                    continue
                if reply.ok and len(frames) == 2:
                    try:
                        out[reply.handle] = TrajectoryRing.decode(frames[1].buffer, reply.handle)
                    except StaleHandle:
                        out[reply.handle] = None
                    else:
                        self.records += 1
                        self.bytes += reply.handle.length
                else:
                    out[reply.handle] = None
            serve()
        return out

    def close(self) -> None:
        for s in self._socks.values():
            s.close(linger=0)
