"""``python -m staleflow.launch.torchrun [torchrun args]``: torchrun whose stores listen on
loopback only, when the rendezvous endpoint and --local-addr are loopback (single-node runs).

torchrun hosts two TCPStores (the c10d rendezvous store, and the store the workers bootstrap
their process groups from) and torch binds both to every interface, whatever address it is
given: on a shared machine any host could join or poison the rendezvous. TCPStore accepts an
already-listening socket (``master_listen_fd``), so this wrapper binds that socket to 127.0.0.1
itself and hands it over; every other torchrun behaviour (elastic restarts, worker monitoring)
is unchanged. Multi-node runs (routable addresses) are not touched. launch.sh uses it.
"""

from __future__ import annotations

import socket
import sys

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _loopback_tcp_store(make):
    def create(host, port, *args, is_master: bool = False, **kw):
        if is_master and host in LOOPBACK and "master_listen_fd" not in kw:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", int(port)))
            sock.listen(1024)
            kw["master_listen_fd"] = sock.detach()
        return make(host, port, *args, is_master=is_master, **kw)

    return create


def main() -> None:
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic
    from torch.distributed.run import main as torchrun_main

    if hasattr(c10d_backend, "TCPStore"):  # the rendezvous store
        c10d_backend.TCPStore = _loopback_tcp_store(c10d_backend.TCPStore)
    handler = getattr(dynamic, "DynamicRendezvousHandler", None)
    if handler is not None and hasattr(handler, "_create_tcp_store_server"):  # the workers' store
        make = _loopback_tcp_store(dist.TCPStore)
        handler._create_tcp_store_server = lambda self, master_addr, master_port: make(
            master_addr, master_port, is_master=True, multi_tenant=True)
    torchrun_main(sys.argv[1:])


if __name__ == "__main__":
    main()
