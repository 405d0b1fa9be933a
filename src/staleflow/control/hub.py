"""The control-plane hub of the controller process: every rank's messages, with liveness checks.

    ctl = Hub(run_id, roles, parent_pid)     # binds the ZeroMQ ROUTER
    ctl.wait_ready(600)                             # every rank registered (pid) and Ready
    rank, msg = ctl.recv(timeout_s)                 # next message; raises RankDied naming a dead rank
    ctl.send(rank, msg); ctl.broadcast(msg, ranks)

It watches every rank on its node by pid and its parent (rank 0); a rank on another node (a
multi-node run, ``topology``) by its TCP connection: one that stays unreachable for
``remote_lost_s`` (--fault.remote-lost-s: the process or its node is gone) counts as dead. A dead rank stops the run with
a message naming it. Jobs (the smoke check, the training loop) talk to the ranks only through it.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

from staleflow.cluster.roles import Roles
from staleflow.cluster.topology import Topology
from staleflow.control.messages import Failure, Goodbye, Heartbeat, Ready, Register, Shutdown, Welcome
from staleflow.control.sockets import ControlServer, control_address
from staleflow.faults import BadInput, RankLost
from staleflow.runfolder.scratch import pid_alive

REMOTE_LOST_S = 3.0
"""The default of ``Hub.remote_lost_s`` (FaultConfig.remote_lost_s, --fault.remote-lost-s)."""


class RankDied(RankLost):
    """A rank's process disappeared (or reported a Failure) while the run was going on (faults.py:
    save a checkpoint when the trainer is intact, then stop and restart)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class FatalFailure(BadInput, RuntimeError):
    """A rank failed on bad input or a broken environment: the run stops, no restart can help."""


@dataclass
class Hub:
    """Control-plane hub with liveness checks; jobs talk to ranks through it."""

    run_id: str
    roles: Roles
    parent_pid: int
    run_dir: str = ""
    server: ControlServer = None
    pids: dict[int, int] = field(default_factory=dict)
    infos: dict[int, dict] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    stop_requested: str = ""
    stop_at: float = 0.0
    grace_s: float = 0.0
    """While > 0 (an emergency checkpoint), a stop request is honoured only after this many seconds."""
    topology: Topology | None = None
    """Where the ranks are (None: all on this node)."""
    secure: object = None
    """The controller's SecureContext (net/curve.py) when ranks on other nodes connect over TCP."""
    remote_lost_s: float = REMOTE_LOST_S
    """A rank on another node whose connection stays down this long is dead (--fault.remote-lost-s)."""
    stall_s: float = math.inf
    """A registered rank that sends nothing, or stays busy without progress, this long is stuck
    (its pulse thread, workers/pulse.py, reports every second); the job sizes it (--fault.*)."""
    _heard: dict = field(default_factory=dict)  # rank -> when anything last came from it
    _progress: dict = field(default_factory=dict)  # rank -> (counter, since when unchanged while busy)
    _last_beat: float = 0.0
    _lost_since: dict = field(default_factory=dict)
    _held: deque = field(default_factory=deque)
    """Messages received while _find_lost_sibling watched; recv returns them first."""

    def __post_init__(self):
        topo = self.topology
        remote = [r for r in self.all_ranks if topo is not None and not topo.same_node(r, 0)]
        ip = topo.addrs.get(topo.home, "127.0.0.1") if topo is not None else ""
        self.server = ControlServer(
            control_address(self.run_id), self.roles.world_size, remote=self.secure, remote_ranks=remote, ip=ip
        )

    def is_local(self, rank: int) -> bool:
        return self.topology is None or self.topology.same_node(rank, 0)

    @property
    def all_ranks(self) -> list[int]:
        return list(range(self.roles.world_size))

    def describe(self, rank: int) -> str:
        role = self.roles.role(rank)
        extra = f" instance {self.roles.instance_id(rank)}" if role == "rollout" else ""
        pid = self.pids.get(rank)
        node = f", node {self.topology.node_of(rank)}" if self.topology is not None and self.topology.multi_node else ""
        return f"rank {rank} ({role}{extra}{node}{f', pid {pid}' if pid else ''})"

    def _stopping_anyway(self, rank: int) -> bool:
        """A signal stops the run or an emergency checkpoint is under way: torchrun signals every
        rank at once, and rollout ranks (not needed for the save) may leave before the controller."""
        return self.roles.role(rank) == "rollout" and (self.grace_s > 0 or bool(self.stop_requested))

    def _goodbye_queued(self, rank: int, wait_s: float = 0.3) -> bool:
        """Whether ``rank`` said Goodbye before its process ended (a rank stopped by a signal does;
        one killed or crashed does not). Its Goodbye may still sit unread behind the pid check:
        read what has arrived (up to wait_s) into _held, in order, for recv to handle."""
        deadline = time.monotonic() + wait_s
        while True:
            if any(r == rank and isinstance(m, Goodbye) for r, m in self._held):
                return True
            got = self.server.recv(0.02)
            if got is not None:
                self._held.append(got)
            elif time.monotonic() >= deadline:
                return False

    def _raise_if_dead(self) -> None:
        for rank, pid in self.pids.items():
            if rank not in self.left and self.is_local(rank) and not pid_alive(pid):
                if self._goodbye_queued(rank):
                    continue  # it left in order: recv reads its Goodbye next (a dead rank is checked first)
                raise RankDied(f"{self.describe(rank)} died unexpectedly", rank=rank)
        now = time.monotonic()
        for rank, since in self._lost_since.items():
            if rank not in self.left and now - since > self.remote_lost_s:
                if self._goodbye_queued(rank):
                    continue  # it left in order and closed its connection while the hub was busy elsewhere
                raise RankDied(
                    f"{self.describe(rank)} lost its connection to the controller for {self.remote_lost_s:.1f} s "
                    f"(its process or its node is gone; --fault.remote-lost-s sets the limit)",
                    rank=rank,
                )

    def _find_lost_sibling(self) -> None:
        """A rank of another node that left on a signal was most likely stopped by its torchrun
        agent because a rank beside it died: keep heart-beating for up to remote_lost_s and a bit,
        so that _raise_if_dead names the rank whose connection is lost (the cause). Messages that
        arrive meanwhile are kept for recv (a StepDone dropped here would stall the emergency save)."""
        start = time.monotonic()
        while time.monotonic() < start + self.remote_lost_s + 1.5:
            got = self.server.recv(0.1)
            if got is not None:
                if isinstance(got[1], Goodbye):
                    self.left.add(got[0])  # stopped by the same agent: not the cause
                else:
                    self._held.append(got)
            self._heartbeat()
            self._raise_if_dead()
            if time.monotonic() > start + 1.5 and all(r in self.left for r in self._lost_since):
                return  # nobody went missing: the signal itself is the cause

    def _heartbeat(self) -> None:
        """Heartbeats to every rank; a registered remote rank that cannot be reached starts its clock."""
        lost = set(self.server.broadcast(self.all_ranks, Heartbeat(rank=-1)))
        now = time.monotonic()
        for rank in self.pids:
            if rank in lost:
                self._lost_since.setdefault(rank, now)
            else:
                self._lost_since.pop(rank, None)

    def _on_pulse(self, rank: int, msg: Heartbeat) -> None:
        count, since = self._progress.get(rank, (None, 0.0))
        if count != msg.progress or not msg.busy:
            self._progress[rank] = (msg.progress, time.monotonic())

    def _raise_if_stuck(self) -> None:
        """A rank that stopped talking (SIGSTOP: its pulse thread stops with it) or that has work and
        makes no progress for stall_s is stuck: named, killed when it runs here (a stopped process
        cannot act on torchrun's SIGTERM), and the run restarts from its newest checkpoint."""
        if self.stall_s == math.inf:
            return
        now = time.monotonic()
        for rank, heard in self._heard.items():
            if rank in self.left or rank not in self.pids:
                continue
            silent = now - heard
            busy_for = now - self._progress.get(rank, (0, now))[1]
            if silent > self.stall_s or busy_for > self.stall_s:
                why = (
                    f"sent nothing for {silent:.0f} s (stopped or hung)"
                    if silent > self.stall_s
                    else f"made no progress for {busy_for:.0f} s while it had work (hung)"
                )
                if self.is_local(rank):
                    try:
                        os.kill(self.pids[rank], signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                raise RankDied(
                    f"{self.describe(rank)} {why}: stopped it; the run restarts from its newest "
                    f"checkpoint (--fault.stall-s sets the limit, now {self.stall_s:.0f} s)",
                    rank=rank,
                )

    def check_alive(self) -> None:
        """Raise RankDied naming the first rank whose process is gone; also stop if rank 0 vanished.

        A dead rank is the root cause of whatever follows (torchrun then signals the others), so
        it is checked before the parent, a stop request or another rank's failure report.
        """
        self._raise_if_dead()
        self._raise_if_stuck()
        if os.getppid() != self.parent_pid:
            raise RankDied(f"{self.describe(0)} died (the controller lost its parent)", rank=0)
        if self.stop_requested and time.monotonic() - self.stop_at >= self.grace_s:
            raise KeyboardInterrupt(self.stop_requested)

    def recv(self, timeout_s: float):
        """Next (rank, message) or None; checks liveness, answers Register/Goodbye/Failure itself."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            now = time.monotonic()
            if now - self._last_beat > 1.0:
                self._heartbeat()
                self._last_beat = now
            got = self._held.popleft() if self._held else self.server.recv(min(0.05, max(0.0, deadline - now)))
            if got is not None:
                rank, msg = got
                self._heard[rank] = time.monotonic()
                if isinstance(msg, Heartbeat):  # a rank's pulse: progress, never the job's business
                    self._on_pulse(rank, msg)
                    continue
                if isinstance(msg, Register):
                    self.pids[rank] = msg.pid
                    continue
                if isinstance(msg, Failure):
                    if msg.fatal:
                        raise FatalFailure(f"{self.describe(rank)}: {msg.error}")
                    self._raise_if_dead()
                    raise RankDied(f"{self.describe(rank)} failed: {msg.error}", rank=rank)
                if isinstance(msg, Goodbye):
                    self.left.add(rank)
                    if self._stopping_anyway(rank):
                        continue
                    if not msg.ok:
                        time.sleep(0.2)  # a signal-driven goodbye: let torchrun reap a dead rank first
                        self._raise_if_dead()
                        if not self.is_local(rank) and msg.reason.startswith("interrupted"):
                            self._find_lost_sibling()
                        raise RankDied(f"{self.describe(rank)} left: {msg.reason}", rank=rank)
                    continue
                return rank, msg
            if time.monotonic() >= deadline:
                return None

    def send(self, rank: int, msg) -> None:
        if not self.server.send(rank, msg):
            self.check_alive()

    def broadcast(self, msg, ranks=None) -> None:
        self.server.broadcast(self.all_ranks if ranks is None else ranks, msg)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every rank has registered and reported Ready."""
        deadline = time.monotonic() + timeout_s
        while len(self.infos) < self.roles.world_size:
            got = self.recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                missing = [r for r in self.all_ranks if r not in self.infos]
                raise RankDied(f"ranks {missing} did not become ready within {timeout_s:.0f}s")
            rank, msg = got
            if isinstance(msg, Ready):
                self.infos[rank] = msg.info
        self.broadcast(Welcome(run_id=self.run_id, world_size=self.roles.world_size))

    def shutdown(self, reason: str, ok: bool, wait_s: float = 10.0, restart: bool = False) -> None:
        """Tell every rank to stop and wait (briefly) for their Goodbyes. ``restart``: the failure is
        one an elastic restart may fix (ranks on other nodes then exit non-zero, so that their
        torchrun agents restart them too)."""
        self.broadcast(Shutdown(reason=reason, ok=ok, restart=restart))
        deadline = time.monotonic() + wait_s
        while len(self.left) < len(self.pids) and time.monotonic() < deadline:
            remote = [r for r in self.pids if r not in self.left and not self.is_local(r)]
            if remote:
                self.left.update(self.server.broadcast(remote, Heartbeat(rank=-1)))  # unreachable: gone
            got = self.server.recv(0.05)
            if got and isinstance(got[1], Goodbye):
                self.left.add(got[0])
            for rank, pid in self.pids.items():
                if rank not in self.left and self.is_local(rank) and not pid_alive(pid):
                    self.left.add(rank)

    @contextmanager
    def beating(self, every_s: float = 1.0):
        """Heartbeats from a thread while the caller is busy without the hub (the job is being built:
        tokenizer, data, reward pool), so that no rank gives up on a silent controller. Meanwhile the
        socket is used under a lock (ZeroMQ sockets are not thread-safe). A controller whose parent
        (rank 0) died meanwhile exits: nothing of its run is left to serve."""
        raw, lock, stop = self.server, threading.Lock(), threading.Event()

        def beat():
            while not stop.wait(every_s):
                if os.getppid() != self.parent_pid:
                    print(f"staleflow: {self.describe(0)} died while the job was built", file=sys.stderr, flush=True)
                    os._exit(1)
                with lock:
                    raw.broadcast(self.all_ranks, Heartbeat(rank=-1))

        self.server = _Serialized(raw, lock)
        thread = threading.Thread(target=beat, name="staleflow-hub-beat", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.server = raw
            self._last_beat = 0.0  # the next recv beats at once

    def close(self) -> None:
        self.server.close()


class _Serialized:
    """A ControlServer whose methods run under a lock (Hub.beating's thread shares the socket)."""

    def __init__(self, server: ControlServer, lock: threading.Lock):
        self._server, self._lock = server, lock

    def __getattr__(self, name):
        value = getattr(self._server, name)
        if not callable(value):
            return value

        def locked(*args, **kwargs):
            with self._lock:
                return value(*args, **kwargs)

        return locked
