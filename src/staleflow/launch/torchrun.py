"""``python -m staleflow.launch.torchrun [torchrun args]``: torchrun whose stores listen only on the
address they are given, when that address is loopback or an IP of this machine.

torchrun hosts TCPStores (the c10d rendezvous store and the store the workers bootstrap their
process groups from, or the static rendezvous' single store) and torch binds them to every
interface, whatever address it is given: on a shared machine any host could join or poison the
rendezvous. TCPStore accepts an already-listening socket (``master_listen_fd``), so this wrapper
binds that socket itself and hands it over:
  - single-node runs (launch.sh: rendezvous endpoint and --local-addr 127.0.0.1) listen on loopback;
  - multi-node runs given IP addresses (``--master-addr 10.0.0.1``, ``--rdzv-endpoint 10.0.0.1:29400``,
    ``--local-addr``) listen on that interface only (two agents on one machine: on loopback);
  - a host name is left to torch (every interface): another node may resolve it to an address this
    machine does not know it has (a Debian host's own name resolves to 127.0.1.1 locally).
It also guards the rendezvous (launch/rendezvous_guard.py): torch's c10d rendezvous unpickles its
state from that unauthenticated store; here it is decoded by an unpickler that admits only the
rendezvous' own types, so a process that writes the key cannot run code in the agent. And it tells
its workers its pid (STALEFLOW_AGENT_PID): every rank dies with the agent (launch/lifeline.py).
Every other torchrun behaviour (rendezvous, elastic restarts, worker monitoring) is unchanged.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def listen_address(host: str) -> str | None:
    """The address a store for ``host`` should listen on, or None for torch's default (all)."""
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_unspecified:
        return None
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:  # an address of this machine? (binding port 0 tells, without keeping anything)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError:
        return None
    return host


def _bound_tcp_store(make):
    """Wrap a TCPStore constructor: a master store gets a socket listening on listen_address(host)."""

    def create(host, port, *args, **kw):
        is_master = kw.get("is_master", args[1] if len(args) > 1 else False)
        addr = listen_address(host) if is_master and kw.get("master_listen_fd") is None else None
        if addr is not None:
            sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((addr, int(port)))
                sock.listen(1024)
            except OSError:
                # Taken (another agent on this machine hosts the c10d store): torch's own attempt then
                # fails the way its rendezvous expects, and it joins that store as a client.
                sock.close()
            else:
                kw["master_listen_fd"] = sock.detach()
        return make(host, port, *args, **kw)

    return create


def _rdzv_id(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg in ("--rdzv-id", "--rdzv_id") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(("--rdzv-id=", "--rdzv_id=")):
            return arg.split("=", 1)[1]
    return "<run id>"


def main() -> None:
    from staleflow.launch.import_path import working_directory_off

    working_directory_off()  # the workers start with PYTHONSAFEPATH=1 (launch/import_path.py)
    from staleflow.launch.rendezvous_guard import GuardError, install

    try:
        guard = install(f"key torch.rendezvous.{_rdzv_id(sys.argv[1:])}")
    except GuardError as e:
        print(f"staleflow: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    os.environ["STALEFLOW_AGENT_PID"] = str(os.getpid())  # the workers inherit it (launch/lifeline.py)

    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous as static
    from torch.distributed.run import main as torchrun_main

    if hasattr(c10d_backend, "TCPStore"):  # the c10d rendezvous store
        c10d_backend.TCPStore = _bound_tcp_store(c10d_backend.TCPStore)
    if hasattr(static, "TCPStore"):  # the static rendezvous store (--master-addr/--node-rank)
        static.TCPStore = _bound_tcp_store(static.TCPStore)
    handler = getattr(dynamic, "DynamicRendezvousHandler", None)
    if handler is not None and hasattr(handler, "_create_tcp_store_server"):  # the workers' store
        make = _bound_tcp_store(dist.TCPStore)
        handler._create_tcp_store_server = lambda self, master_addr, master_port: make(
            master_addr, master_port, is_master=True, multi_tenant=True
        )
    try:
        torchrun_main(sys.argv[1:])
    except Exception:
        if guard.refused:  # said in one line when it was refused; torch's traceback adds nothing
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
