"""Which address a node's servers listen on, and tcp:// endpoints on it.

    ip = ip_towards(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))   # e.g. 10.0.0.7
    endpoint = bind_tcp(sock, ip)                                                 # tcp://10.0.0.7:41873

A server binds the one interface whose route reaches the rendezvous host (what the kernel would
use to send there), never all interfaces: on a machine with a public and a cluster network only the
cluster side listens. STALEFLOW_BIND_ADDR overrides the address (e.g. when MASTER_ADDR is a host
name that resolves to 127.0.1.1 on its own machine); STALEFLOW_PORT_RANGE=LO-HI keeps every port
inside a range a firewall opens (default: any free port).
"""

from __future__ import annotations

import os
import socket

import zmq


def ip_towards(host: str, port: int = 9) -> str:
    """The local source address of the route to ``host`` (no packet is sent: a UDP connect only
    asks the kernel which interface it would use)."""
    override = os.environ.get("STALEFLOW_BIND_ADDR", "").strip()
    if override:
        return override
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise OSError(
            f"cannot resolve the rendezvous host {host!r} ({e}): give --master-addr as an IP address or "
            f"set STALEFLOW_BIND_ADDR to this node's cluster address"
        ) from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def tcp_endpoint(ip: str, port: int | str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def port_range() -> tuple[int, int] | None:
    spec = os.environ.get("STALEFLOW_PORT_RANGE", "").strip()
    if not spec:
        return None
    try:
        lo, hi = (int(x) for x in spec.split("-"))
    except ValueError:
        raise ValueError(f"STALEFLOW_PORT_RANGE={spec!r} is invalid: use LO-HI, e.g. 29600-29700") from None
    if not 0 < lo <= hi < 65536:
        raise ValueError(f"STALEFLOW_PORT_RANGE={spec!r} is invalid: need 0 < LO <= HI < 65536")
    return lo, hi


def bind_tcp(sock: zmq.Socket, ip: str) -> str:
    """Bind ``sock`` on ``ip`` (a free port, inside STALEFLOW_PORT_RANGE if set); returns the endpoint."""
    if ":" in ip:
        sock.setsockopt(zmq.IPV6, 1)
    rng = port_range()
    if rng is None:
        sock.bind(tcp_endpoint(ip, "*"))
    else:
        try:
            host = f"tcp://[{ip}]" if ":" in ip else f"tcp://{ip}"
            sock.bind_to_random_port(host, min_port=rng[0], max_port=rng[1] + 1, max_tries=4 * (rng[1] - rng[0] + 1))
        except zmq.ZMQBindError:
            raise OSError(
                f"no free port on {ip} in STALEFLOW_PORT_RANGE={rng[0]}-{rng[1]}: widen the range "
                f"(each node needs a few ports per rank)"
            ) from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
