"""The TCP control plane between nodes: CURVE with per-run keys. A rank with the run's secret is
heard; a peer with another secret, a raw TCP client, a rank claiming another rank's identity and
a malformed message are refused with a log line and never reach (or crash) the controller; a
remote rank whose connection is lost is declared dead by the hub."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest
import zmq

from staleflow.cluster.roles import Roles
from staleflow.cluster.topology import Topology
from staleflow.control.hub import Hub, RankDied
from staleflow.control.messages import Goodbye, Heartbeat, Ping, Register, encode
from staleflow.control.sockets import ControlClient, ControlServer
from staleflow.net.curve import RunKeys, SecureContext, new_secret

WORLD = 4


@pytest.fixture
def plane(tmp_path):
    keys = RunKeys(new_secret(), WORLD)
    secure = SecureContext(keys, "controller")
    server = ControlServer(f"ipc://{tmp_path}/ctl", WORLD, remote=secure, remote_ranks=[2, 3], ip="127.0.0.1")
    made = []

    def client(rank: int, keys_: RunKeys = keys, identity: int | None = None):
        ctx = SecureContext(keys_, f"rank {rank}", rank)
        made.append(ctx)
        if identity is None:
            return ControlClient(server.tcp_endpoint, rank, secure=ctx)
        return ctx.client(zmq.DEALER, server.tcp_endpoint, identity=b"r%d" % identity)

    yield server, secure, client
    server.close()
    secure.close()
    for ctx in made:
        ctx.close()


def _stderr_until(capfd, text: str, timeout: float = 5.0) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += capfd.readouterr().err
        if text in seen:
            return seen
        time.sleep(0.05)
    return seen


def test_multinode_rank_with_the_run_secret_is_heard_over_tcp_and_answered(plane, tmp_path):
    server, _, client = plane
    assert server.tcp_endpoint.startswith("tcp://127.0.0.1:")  # the given interface, not 0.0.0.0
    c = client(2)
    c.send(Ping(rank=2, seq=7, payload="hi"))
    assert server.recv(10.0) == (2, Ping(rank=2, seq=7, payload="hi"))
    assert server.send(2, Ping(rank=-1, seq=8))
    assert c.recv(10.0) == Ping(rank=-1, seq=8)
    local = ControlClient(f"ipc://{tmp_path}/ctl", 0)  # ranks on the controller's node: ipc, as before
    local.send(Ping(rank=0, seq=1))
    assert server.recv(10.0) == (0, Ping(rank=0, seq=1))
    local.close()
    c.close()


def test_multinode_peer_with_a_wrong_secret_is_refused_with_a_log_line(plane, capfd):
    server, secure, client = plane
    intruder = client(3, keys_=RunKeys(new_secret(), WORLD))
    intruder.send(Ping(rank=3, seq=1))
    err = _stderr_until(capfd, "failed the CURVE handshake")
    assert "staleflow: controller: refused a connection" in err and "wrong run secret" in err, err
    assert server.recv(0.5) is None  # nothing reached the controller
    assert secure.gate.refused >= 1
    ok = client(2)  # the run goes on
    ok.send(Ping(rank=2, seq=2))
    assert server.recv(10.0) == (2, Ping(rank=2, seq=2))
    intruder.close()
    ok.close()


def test_multinode_peer_knowing_the_server_key_but_no_rank_key_is_refused_by_the_gatekeeper(plane, capfd):
    server, secure, _ = plane
    ctx = zmq.Context()
    pub, sec = zmq.curve_keypair()  # e.g. a rank of another run that learnt this server's public key
    s = ctx.socket(zmq.DEALER)
    s.curve_serverkey, s.curve_publickey, s.curve_secretkey = secure.keys.server_public, pub, sec
    s.setsockopt(zmq.IDENTITY, b"r3")
    s.connect(server.tcp_endpoint)
    s.send(encode(Ping(rank=3, seq=1)))
    err = _stderr_until(capfd, "not one of this run's ranks")
    assert "refused a connection from 127.0.0.1: its CURVE key is not one of this run's ranks" in err, err
    assert server.recv(0.5) is None
    s.close(linger=0)
    ctx.term()


def test_multinode_raw_tcp_garbage_is_refused_and_logged(plane, capfd):
    server, _, client = plane
    host, port = server.tcp_endpoint[len("tcp://") :].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(512))
        time.sleep(0.2)
    err = _stderr_until(capfd, "failed the CURVE handshake")
    assert "staleflow: controller: refused a connection from " in err, err
    c = client(2)
    c.send(Ping(rank=2, seq=3))
    assert server.recv(10.0) == (2, Ping(rank=2, seq=3))
    c.close()


def test_multinode_impersonation_and_malformed_messages_are_dropped_not_raised(plane, capfd):
    server, _, client = plane
    liar = client(2, identity=3)  # rank 2's key, rank 3's identity
    liar.send(encode(Ping(rank=3, seq=1)))  # a well-formed message, from the wrong connection
    assert server.recv(1.0) is None
    assert "authenticated as rank 2 sent as rank 3" in _stderr_until(capfd, "sent as rank 3")
    raw = client(2, identity=2)
    raw.send(b"\xc1 not msgpack")
    assert server.recv(1.0) is None
    assert "rank 2 sent a malformed message" in _stderr_until(capfd, "malformed")
    raw.send_multipart([b"extra", b"frames"])
    assert server.recv(1.0) is None
    assert server.dropped == 3
    raw.close(linger=0)  # a ROUTER refuses a second live connection with the same identity
    time.sleep(0.2)
    good = client(2)
    good.send(Ping(rank=2, seq=9))
    assert server.recv(10.0) == (2, Ping(rank=2, seq=9))  # still serving
    liar.close()
    good.close()


def test_multinode_broadcast_reports_remote_ranks_it_cannot_reach(plane):
    server, _, client = plane
    c = client(2)
    c.send(Ping(rank=2, seq=1))
    assert server.recv(10.0) is not None
    assert server.broadcast([0, 1, 2, 3], Heartbeat(rank=-1)) == [3]  # 3 never connected; local ranks unjudged
    c.close()


@pytest.fixture
def remote_hub():
    """(hub, client of rank 2 on node 1, registered and heard from once), remote_lost_s 0.3 s."""
    from staleflow.runfolder.scratch import remove_run_folder

    roles = Roles(WORLD, 2)
    topo = Topology.from_ranks(roles, [0, 0, 1, 1], [0, 1, 0, 1], {0: "127.0.0.1", 1: "127.0.0.1"})
    keys = RunKeys(new_secret(), WORLD)
    secure = SecureContext(keys, "controller")
    ctl = Hub(
        run_id=uuid.uuid4().hex[:10],
        roles=roles,
        parent_pid=os.getppid(),
        topology=topo,
        secure=secure,
        remote_lost_s=0.3,
    )
    rank_ctx = SecureContext(keys, "rank 2", 2)
    try:
        c = ControlClient(ctl.server.tcp_endpoint, 2, secure=rank_ctx)
        c.send(Register(rank=2, role="rollout", pid=999999999, host="elsewhere", node=1))  # a pid of another node
        c.send(Ping(rank=2, seq=1))
        assert ctl.recv(10.0) == (2, Ping(rank=2, seq=1))  # its pid is not checked here
        yield ctl, c
    finally:
        ctl.close()
        rank_ctx.close()
        secure.close()
        remove_run_folder(ctl.run_id)


def test_multinode_hub_declares_a_remote_rank_dead_when_its_connection_is_lost(remote_hub):
    ctl, c = remote_hub
    assert ctl.describe(2) == "rank 2 (rollout instance 0, node 1, pid 999999999)"
    c.close()
    with pytest.raises(
        RankDied, match=r"rank 2 \(rollout instance 0, node 1.*lost its connection.* for 0\.3 s.*--fault\.remote-lost-s"
    ):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ctl.recv(0.2)


def test_multinode_hub_reads_a_remote_ranks_goodbye_before_judging_its_lost_connection(remote_hub):
    """A remote rank that said Goodbye and closed while the controller was busy elsewhere for longer than
    remote_lost_s left in order: the hub reads the queued Goodbye instead of declaring the rank dead."""
    ctl, c = remote_hub
    c.send(Goodbye(rank=2, ok=True, reason="done"))
    c.close()
    time.sleep(0.5)  # the connection is gone; nothing has read the Goodbye yet
    ctl._heartbeat()  # its lost clock starts
    time.sleep(0.5)  # the controller busy elsewhere, past remote_lost_s
    assert ctl.recv(1.0) is None and 2 in ctl.left
