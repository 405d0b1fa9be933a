"""ZeroMQ control plane: the controller binds a ROUTER socket, every rank connects a DEALER.

Addresses are ipc:// files under a per-run folder on one node (tcp:// works the same across
nodes). Messages are typed msgspec Structs (staleflow.launch.messages); the socket identity of
a rank is its global rank, so the controller addresses ranks by number.
"""

from __future__ import annotations

import os

import zmq

from staleflow.launch.messages import decode, encode


def control_address(run_id: str) -> str:
    """The controller's ipc:// address for a run (short path: ipc paths are limited to ~100 bytes)."""
    from staleflow.launch.cleanup import run_folder

    folder = run_folder(run_id)
    os.makedirs(folder, exist_ok=True)
    return f"ipc://{folder}/ctl"


def _identity(rank: int) -> bytes:
    return b"r%d" % rank


class ControlServer:
    """Controller side: receive from any rank, send to one rank or broadcast."""

    def __init__(self, address: str):
        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def recv(self, timeout_s: float) -> tuple[int, object] | None:
        """Next (rank, message), or None after timeout_s seconds."""
        if not self._poller.poll(int(timeout_s * 1000)):
            return None
        ident, data = self._sock.recv_multipart()
        return int(ident[1:]), decode(data)

    def recv_all(self) -> list[tuple[int, object]]:
        """Every message already queued, without waiting."""
        out = []
        while True:
            try:
                ident, data = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append((int(ident[1:]), decode(data)))

    def send(self, rank: int, msg) -> bool:
        """Send to one rank; False if that rank is not connected (dead or not yet up)."""
        try:
            self._sock.send_multipart([_identity(rank), encode(msg)], zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def broadcast(self, ranks, msg) -> None:
        data = encode(msg)
        for r in ranks:
            try:
                self._sock.send_multipart([_identity(r), data], zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                pass

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://") :])
            except FileNotFoundError:
                pass


class ControlClient:
    """Rank side: one DEALER socket to the controller."""

    def __init__(self, address: str, rank: int):
        self.rank = rank
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, _identity(rank))
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.connect(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def send(self, msg) -> None:
        self._sock.send(encode(msg))

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
        self._ctx.term()
