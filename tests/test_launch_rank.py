"""A rank's liveness checks: a busy rank is not fooled by heartbeats waiting in its socket, a dead
or silent controller stops it with a message, a stop signal keeps a trainer serving for its grace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque

import pytest

from staleflow.cluster.roles import Roles
from staleflow.config import RunConfig
from staleflow.control.messages import Heartbeat, Ping
from staleflow.workers import rank as rank_mod
from staleflow.workers.rank import RankContext, RunStopped


class QueueClient:
    def __init__(self, *msgs):
        self.queue = deque(msgs)

    def recv(self, timeout):
        return self.queue.popleft() if self.queue else None


def ctx(client, controller_pid=0, role_rank=0):
    return RankContext(
        cfg=RunConfig(), roles=Roles(3, 2), rank=role_rank, run_id="x", client=client, controller_pid=controller_pid
    )


def test_rank_busy_longer_than_the_timeout_reads_waiting_heartbeats_first(monkeypatch):
    monkeypatch.setattr(rank_mod, "HEARTBEAT_TIMEOUT_S", 1.0)
    c = ctx(QueueClient(Heartbeat(rank=-1), Heartbeat(rank=-1), Ping(rank=-1, seq=1)))
    c._last_heard = time.monotonic() - 100  # a long training step: nothing read meanwhile
    assert c.recv(0.0) == Ping(rank=-1, seq=1)


def test_rank_stops_when_the_controller_is_silent_or_dead(monkeypatch):
    monkeypatch.setattr(rank_mod, "HEARTBEAT_TIMEOUT_S", 1.0)
    c = ctx(QueueClient())
    c._last_heard = time.monotonic() - 100
    with pytest.raises(RunStopped, match="sent nothing for 1 s"):
        c.recv(0.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    c = ctx(QueueClient(), controller_pid=dead.pid)
    with pytest.raises(RunStopped, match=f"the controller \\(pid {dead.pid}\\) died"):
        c.recv(0.0)
    assert ctx(QueueClient(), controller_pid=os.getpid()).recv(0.0) is None  # alive and quiet: just no message
