"""ZeroMQ control plane: the controller binds ROUTER sockets, every rank connects a DEALER.

Ranks on the controller's node connect over ipc:// (a file in the run's folder, as on a single
node); ranks on other nodes over tcp:// with CURVE (net/curve.py): the controller's TCP socket is
bound to the interface that reaches the rendezvous host and admits only this run's rank keys.
Messages are typed msgspec Structs (staleflow.control.messages); the socket identity of a rank is
``r<global rank>``, so the controller addresses ranks by number. Whatever arrives is checked
before it is used: a message that does not decode, a bad identity, or (over TCP) an identity other
than the rank the connection authenticated as, is dropped with a log line; nothing a peer sends
can raise out of ``recv``.
"""

from __future__ import annotations

import os
import re
import sys
import time

import msgspec
import zmq

from staleflow.control.messages import decode, encode
from staleflow.net.curve import SecureContext, user_rank

_IDENTITY = re.compile(rb"^[rp](\d{1,7})$")  # r<rank>: the rank's socket; p<rank>: its pulse thread's
MAX_CONTROL_MSG = 64 << 20


def control_address(run_id: str) -> str:
    """The controller's ipc:// address for a run (short path: ipc paths are limited to ~100 bytes)."""
    from staleflow.runfolder.scratch import run_folder

    folder = run_folder(run_id)
    os.makedirs(folder, exist_ok=True)
    return f"ipc://{folder}/ctl"


def _identity(rank: int, pulse: bool = False) -> bytes:
    return b"%s%d" % (b"p" if pulse else b"r", rank)


class ControlServer:
    """Controller side: receive from any rank, send to one rank or broadcast.

    ``remote`` (a SecureContext), ``remote_ranks`` and ``ip``: also bind a CURVE TCP socket for the
    ranks on other nodes; ``self.tcp_endpoint`` is where they connect."""

    def __init__(
        self, address: str, world_size: int = 0, remote: SecureContext | None = None, remote_ranks=(), ip: str = ""
    ):
        self.address, self.world_size = address, world_size
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MSG)
        self._sock.bind(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self.remote_ranks = frozenset(remote_ranks)
        self._tcp, self.tcp_endpoint = None, ""
        if remote is not None and self.remote_ranks:
            self._tcp, self.tcp_endpoint = remote.server(zmq.ROUTER, ip, b"control", max_msg=MAX_CONTROL_MSG)
            self._tcp.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._poller.register(self._tcp, zmq.POLLIN)
        self.dropped = 0
        self._last_log = 0.0

    def _socket_of(self, rank: int) -> zmq.Socket:
        return self._tcp if rank in self.remote_ranks and self._tcp is not None else self._sock

    def _drop(self, why: str) -> None:
        """A message we cannot use: count it, say so (at most once a second), carry on."""
        self.dropped += 1
        now = time.monotonic()
        if now - self._last_log > 1.0:
            self._last_log = now
            print(f"staleflow: control plane: dropped a message: {why}", file=sys.stderr, flush=True)

    def _read(self, sock: zmq.Socket) -> tuple[int, object] | None:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if len(frames) != 2:
            self._drop(f"{len(frames)} frames instead of 2 (identity, body)")
            return None
        m = _IDENTITY.match(frames[0].bytes)
        rank = int(m.group(1)) if m else -1
        if rank < 0 or (self.world_size and rank >= self.world_size):
            self._drop(f"unknown sender identity {frames[0].bytes[:16]!r}")
            return None
        if sock is self._tcp:
            who = user_rank(frames[1])
            if who != rank or rank not in self.remote_ranks:
                self._drop(f"a peer authenticated as rank {who} sent as rank {rank}")
                return None
        try:
            return rank, decode(frames[1].bytes)
        except (msgspec.MsgspecError, ValueError, TypeError) as e:
            self._drop(f"rank {rank} sent a malformed message ({str(e)[:120]})")
            return None

    def recv(self, timeout_s: float) -> tuple[int, object] | None:
        """Next valid (rank, message), or None after timeout_s seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = dict(self._poller.poll(int(max(0.0, deadline - time.monotonic()) * 1000)))
            if not ready:
                return None
            for sock in (self._sock, self._tcp):
                if sock is not None and sock in ready:
                    got = self._read(sock)
                    if got is not None:
                        return got
            if time.monotonic() >= deadline:
                return None

    def recv_all(self) -> list[tuple[int, object]]:
        """Every valid message already queued, without waiting."""
        out = []
        for sock in (self._sock, self._tcp):
            while sock is not None:
                try:
                    if not sock.poll(0):
                        break
                except zmq.ZMQError:
                    break
                got = self._read(sock)
                if got is not None:
                    out.append(got)
        return out

    def send(self, rank: int, msg) -> bool:
        """Send to one rank; False if that rank is not connected (dead or not yet up)."""
        try:
            self._socket_of(rank).send_multipart([_identity(rank), encode(msg)], zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def broadcast(self, ranks, msg) -> list[int]:
        """Send to every rank of ``ranks``; returns the remote ranks that are not connected
        (a lost TCP connection: the hub's liveness check for ranks whose pid it cannot see)."""
        data = encode(msg)
        lost = []
        for r in ranks:
            try:
                self._socket_of(r).send_multipart([_identity(r), data], zmq.NOBLOCK)
            except zmq.Again:  # full queue: a rank busy for a long while, not a lost one
                pass
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH and r in self.remote_ranks:
                    lost.append(r)
        return lost

    def close(self) -> None:
        self._sock.close()
        if self._tcp is not None:
            self._tcp.close(linger=200)
        self._ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://") :])
            except FileNotFoundError:
                pass


class ControllerGone(RuntimeError):
    """A message to the controller could not be queued for the send timeout: it is gone or stuck."""


SEND_TIMEOUT_S = float(os.environ.get("STALEFLOW_SEND_TIMEOUT_S", "120"))


class ControlClient:
    """Rank side: one DEALER socket to the controller (ipc on its node, CURVE TCP from elsewhere).

    A send never blocks for ever: ZeroMQ queues up to its high-water mark (1000 messages) while
    the controller is away; ``send`` then waits at most ``timeout_s`` for room and raises
    ControllerGone; ``send_stats`` (snapshots, which the next one supersedes) drops instead."""

    def __init__(self, address: str, rank: int, secure: SecureContext | None = None, pulse: bool = False):
        """pulse: the socket of the rank's pulse thread (its own identity, the same rank)."""
        self.rank = rank
        self._ctx = None
        if secure is not None:
            self._sock = secure.client(zmq.DEALER, address, identity=_identity(rank, pulse))
        else:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.IDENTITY, _identity(rank, pulse))
            self._sock.setsockopt(zmq.LINGER, 500)
            self._sock.connect(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self.stats_dropped = 0

    def send(self, msg, timeout_s: float | None = None) -> None:
        """Queue ``msg``; ControllerGone if there is no room for ``timeout_s`` (default SEND_TIMEOUT_S)."""
        data = encode(msg)
        timeout = SEND_TIMEOUT_S if timeout_s is None else timeout_s
        if self._sock.poll(int(timeout * 1000), zmq.POLLOUT):
            try:
                self._sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        raise ControllerGone(
            f"rank {self.rank}: the controller took no message for {timeout:.0f} s "
            f"({type(msg).__name__} not sent): it is gone or stuck"
        )

    def send_stats(self, msg) -> bool:
        """Queue a message that a newer one supersedes (a snapshot); dropped when the queue is full."""
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.stats_dropped += 1
            return False

    def recv(self, timeout_s: float):
        """Next message from the controller, or None after timeout_s seconds."""
        if not self._poller.poll(int(timeout_s * 1000)):
            return None
        return decode(self._sock.recv())

    def recv_all(self) -> list:
        out = []
        while True:
            try:
                out.append(decode(self._sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out

    def close(self) -> None:
        self._sock.close()
        if self._ctx is not None:
            self._ctx.term()
