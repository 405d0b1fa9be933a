"""Per-run CURVE keys, and the gatekeeper that admits only this run's ranks to a TCP socket.

    keys = RunKeys(secret, world_size)                 # secret: 32 random bytes drawn by rank 0
    net = SecureContext(keys, "trainer 0")             # one per process
    sock, endpoint = net.server(zmq.ROUTER, ip, b"weights")
    sock = net.client(zmq.DEALER, endpoint, rank=3)

Every TCP socket of a run uses ZeroMQ CURVE: a Curve25519 key exchange, then every frame is
encrypted and authenticated. All keys derive from one per-run secret:
    server key = HMAC-SHA256(secret, "server")    every server socket of the run
    rank r key = HMAC-SHA256(secret, "rank r")    the client key of global rank r
A server knows every rank's public key (it derives them), so its ZAP handler (the gatekeeper,
one thread per process) admits exactly those keys and names the rank as the connection's User-Id;
receivers check that a message claiming to be rank r came over rank r's connection. A peer
without the secret cannot finish the handshake (it does not know the server key; one that does,
say from an old run, holds no admitted rank key) and never reaches our code: libzmq drops its
bytes and the gatekeeper logs a line (with the peer's address when the kernel still has it).
Clients pin the server key, so nobody can impersonate a server either. ZAP_ENFORCE_DOMAIN makes a socket refuse everyone if the gatekeeper
is not running, rather than admit everyone.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import queue
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq
import zmq.utils.z85 as z85
from zmq.utils.monitor import parse_monitor_message

from staleflow.net.address import bind_tcp

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 20000  # a peer whose host vanished (no FIN) is dropped after this
LOG_EVERY_S = 10.0


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _derive(secret: bytes, label: str) -> bytes:
    return z85.encode(hmac.new(secret, label.encode(), hashlib.sha256).digest())


@dataclass(frozen=True)
class RunKeys:
    """Every key of a run, derived from its 32-byte secret (z85 strings, as ZeroMQ takes them)."""

    secret: bytes
    world_size: int
    _public: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if len(self.secret) != 32:
            raise ValueError(f"a run secret has 32 bytes, got {len(self.secret)}")

    def __repr__(self) -> str:  # never print the secret
        return f"RunKeys(world_size={self.world_size})"

    @property
    def server_secret(self) -> bytes:
        return _derive(self.secret, "server")

    @property
    def server_public(self) -> bytes:
        return zmq.curve_public(self.server_secret)

    def rank_secret(self, rank: int) -> bytes:
        return _derive(self.secret, f"rank {rank}")

    def rank_public(self, rank: int) -> bytes:
        if rank not in self._public:
            self._public[rank] = zmq.curve_public(self.rank_secret(rank))
        return self._public[rank]

    def admitted(self) -> dict[bytes, bytes]:
        """Raw 32-byte public key -> User-Id (the rank as ASCII) of every rank of the run."""
        return {z85.decode(self.rank_public(r)): str(r).encode() for r in range(self.world_size)}


class Gatekeeper:
    """The ZAP handler of one ZeroMQ context: admits the run's rank keys, logs every refusal.

    It also reads the monitor events of the sockets it guards, so a peer that connects and hangs
    up without a CURVE handshake (a port scan, another protocol) is logged too."""

    def __init__(self, ctx: zmq.Context, keys: RunKeys, name: str):
        self.name = name
        self._admitted = keys.admitted()
        self._zap = ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        self._new_monitors: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._last_log: dict[tuple, tuple[float, int]] = {}
        self._accepted: dict[int, str] = {}  # fd -> peer address
        self._credits: dict[str, int] = {}  # peer ip -> ZAP checks not yet matched with a disconnection
        self.refused = 0
        self._thread = threading.Thread(target=self._run, name="staleflow-gatekeeper", daemon=True)
        self._thread.start()

    def watch(self, sock: zmq.Socket) -> None:
        """Log handshake failures on ``sock`` (call before it binds)."""
        self._new_monitors.put(sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED))

    def log(self, what: str, peer: str, text: str) -> None:
        """Rate-limited: one line per (kind, peer) every LOG_EVERY_S, with how many were held back."""
        now = time.monotonic()
        key = (what, peer.rsplit(":", 1)[0])
        last, held = self._last_log.get(key, (-1e9, 0))
        if now - last < LOG_EVERY_S:
            self._last_log[key] = (last, held + 1)
            return
        more = f" ({held} more like it in the last {LOG_EVERY_S:.0f} s)" if held else ""
        print(f"staleflow: {self.name}: refused {text}{more}", file=sys.stderr, flush=True)
        self._last_log[key] = (now, 0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors = []
        while not self._stop.is_set():
            while not self._new_monitors.empty():
                m = self._new_monitors.get()
                monitors.append(m)
                poller.register(m, zmq.POLLIN)
            ready = [s for s, _ in poller.poll(100)]
            # Connection events first: a connection's ACCEPTED is queued before its ZAP request.
            for sock in sorted(ready, key=lambda s: s is self._zap):
                try:
                    if sock is self._zap:
                        self._on_zap(sock.recv_multipart())
                    else:
                        while sock.poll(0):
                            self._on_event(parse_monitor_message(sock.recv_multipart()))
                except zmq.ZMQError:
                    continue
        for m in monitors:
            m.close(linger=0)
        self._zap.close(linger=0)

    def _on_zap(self, frames: list[bytes]) -> None:
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        creds = frames[6:]
        peer = address.decode(errors="replace")
        self._credits[peer] = self._credits.get(peer, 0) + 1
        user = self._admitted.get(creds[0]) if mechanism == b"CURVE" and creds else None
        if user is None:
            self.refused += 1
            self.log(
                "key",
                peer,
                f"a connection from {peer}: its {mechanism.decode(errors='replace')} key is not one "
                f"of this run's ranks (wrong run secret, or not part of this run)",
            )
            self._zap.send_multipart([version, request_id, b"400", b"not a rank of this run", b"", b""])
            return
        self._zap.send_multipart([version, request_id, b"200", b"OK", user, b""])

    def _on_event(self, ev: dict) -> None:
        """A connection that ends without having reached the ZAP check failed the CURVE handshake:
        a wrong run secret (its server key does not match), or not a ZeroMQ CURVE peer at all.
        Each ZAP check of a peer address is a credit that one disconnection from it consumes (the
        monitor's ACCEPTED may arrive before or after the ZAP request: counts do not care)."""
        kind, fd = ev["event"], ev["value"]
        endpoint = ev["endpoint"].decode(errors="replace")
        if kind == zmq.EVENT_ACCEPTED:
            self._accepted[fd] = _peer_of(fd)
        elif kind == zmq.EVENT_DISCONNECTED and fd in self._accepted:
            peer = self._accepted.pop(fd)
            ip = peer.rsplit(":", 1)[0]
            if self._credits.get(ip, 0) > 0:
                self._credits[ip] -= 1
            else:
                self.refused += 1
                self.log(
                    "handshake",
                    peer or endpoint,
                    f"a connection from {peer or 'an unknown address'} to "
                    f"{endpoint}: it failed the CURVE handshake (wrong run secret, or not a ZeroMQ peer of "
                    f"this run)",
                )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _peer_of(fd: int) -> str:
    """The remote address of an accepted connection's file descriptor (libzmq's), for log lines;
    "" when the connection is already gone (a peer that hung up at once)."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return ""
    try:
        host, port = s.getpeername()[:2]
        return f"{host}:{port}"
    except (OSError, ValueError):
        return ""
    finally:
        s.close()


class SecureContext:
    """One process's ZeroMQ context for TCP sockets: CURVE servers behind the gatekeeper, and
    CURVE clients holding this rank's key."""

    def __init__(self, keys: RunKeys, name: str, rank: int = -1):
        self.keys, self.name, self.rank = keys, name, rank
        self.ctx = zmq.Context()
        self.gate: Gatekeeper | None = None

    def server(self, kind: int, ip: str, domain: bytes, max_msg: int = 1 << 30) -> tuple[zmq.Socket, str]:
        """A CURVE server socket bound on ``ip``; returns it and its endpoint."""
        if self.gate is None:  # before the first bind: no connection is ever judged without it
            self.gate = Gatekeeper(self.ctx, self.keys, self.name)
        sock = self.ctx.socket(kind)
        sock.curve_server = True
        sock.curve_secretkey = self.keys.server_secret
        sock.zap_domain = domain
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        _keepalive(sock)
        self.gate.watch(sock)
        return sock, bind_tcp(sock, ip)

    def client(self, kind: int, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
        """A CURVE client socket of this rank connected to ``endpoint`` (a server of this run)."""
        sock = self.ctx.socket(kind)
        sock.curve_serverkey = self.keys.server_public
        sock.curve_publickey = self.keys.rank_public(self.rank)
        sock.curve_secretkey = self.keys.rank_secret(self.rank)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        _keepalive(sock)
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        """Stop the gatekeeper and drop the context (owners close their sockets first)."""
        if self.gate is not None:
            self.gate.close()
        self.ctx.destroy(linger=500)


def _keepalive(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 500)


def user_rank(frame: zmq.Frame) -> int | None:
    """The rank the gatekeeper authenticated a received frame's connection as (None: not CURVE)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return int(user) if user and user.isdigit() else None


def incoming(sock: zmq.Socket, stop: threading.Event, poll_ms: int = 100):
    """The multipart messages (zero-copy frames) arriving on a server thread's socket, until
    ``stop`` is set; a failed receive is skipped."""
    while not stop.is_set():
        try:
            if not sock.poll(poll_ms):
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            continue
        yield frames
