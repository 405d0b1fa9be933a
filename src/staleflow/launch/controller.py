"""The controller process: started by global rank 0 before CUDA is touched; one per run.

It binds the control plane, waits for every rank to Register (pid) and become Ready, runs the
job (the smoke check, or the training runtime), then broadcasts Shutdown. It watches every
rank's pid and its parent (rank 0): a dead rank stops the run with a message naming it.

    rank 0 ──spawn──> controller  <──ZeroMQ──>  every rank (trainer and rollout)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from staleflow.launch.cleanup import pid_alive
from staleflow.launch.control import ControlServer, control_address
from staleflow.launch.messages import Failure, Goodbye, Heartbeat, Ping, Pong, Ready, Register, Shutdown, Welcome
from staleflow.launch.roles import Roles


class RankDied(RuntimeError):
    """A rank's process disappeared (or reported a Failure) while the run was going on."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


@dataclass
class Controller:
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
    _last_beat: float = 0.0

    def __post_init__(self):
        self.server = ControlServer(control_address(self.run_id))

    @property
    def all_ranks(self) -> list[int]:
        return list(range(self.roles.world_size))

    def describe(self, rank: int) -> str:
        role = self.roles.role(rank)
        extra = f" instance {self.roles.instance_id(rank)}" if role == "rollout" else ""
        pid = self.pids.get(rank)
        return f"rank {rank} ({role}{extra}{f', pid {pid}' if pid else ''})"

    def _raise_if_dead(self) -> None:
        for rank, pid in self.pids.items():
            if rank not in self.left and not pid_alive(pid):
                raise RankDied(f"{self.describe(rank)} died unexpectedly", rank=rank)

    def check_alive(self) -> None:
        """Raise RankDied naming the first rank whose process is gone; also stop if rank 0 vanished.

        A dead rank is the root cause of whatever follows (torchrun then signals the others), so
        it is checked before the parent, a stop request or another rank's failure report.
        """
        self._raise_if_dead()
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
                self.server.broadcast(self.all_ranks, Heartbeat(rank=-1))
                self._last_beat = now
            got = self.server.recv(min(0.05, max(0.0, deadline - now)))
            if got is not None:
                rank, msg = got
                if isinstance(msg, Register):
                    self.pids[rank] = msg.pid
                    continue
                if isinstance(msg, Failure):
                    self._raise_if_dead()
                    raise RankDied(f"{self.describe(rank)} failed: {msg.error}", rank=rank)
                if isinstance(msg, Goodbye):
                    self.left.add(rank)
                    if self.grace_s > 0 and self.roles.role(rank) == "rollout":
                        continue  # stopping anyway (emergency checkpoint): rollout ranks may go
                    if not msg.ok:
                        time.sleep(0.2)  # a signal-driven goodbye: let torchrun reap a dead rank first
                        self._raise_if_dead()
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

    def shutdown(self, reason: str, ok: bool, wait_s: float = 10.0) -> None:
        """Tell every rank to stop and wait (briefly) for their Goodbyes."""
        self.broadcast(Shutdown(reason=reason, ok=ok))
        deadline = time.monotonic() + wait_s
        while len(self.left) < len(self.pids) and time.monotonic() < deadline:
            got = self.server.recv(0.05)
            if got and isinstance(got[1], Goodbye):
                self.left.add(got[0])
            for rank, pid in self.pids.items():
                if rank not in self.left and not pid_alive(pid):
                    self.left.add(rank)

    def close(self) -> None:
        self.server.close()


def smoke_job(ctl: Controller, cfg) -> None:
    """Launcher smoke run: round-trip a message with every rank and print what each loaded."""
    for rank in ctl.all_ranks:
        ctl.send(rank, Ping(rank=-1, seq=rank, payload=f"hello rank {rank}"))
    answered: set[int] = set()
    deadline = time.monotonic() + 60
    while len(answered) < ctl.roles.world_size:
        got = ctl.recv(max(0.0, deadline - time.monotonic()))
        if got is None:
            raise RankDied(f"ranks {sorted(set(ctl.all_ranks) - answered)} did not answer the smoke ping")
        rank, msg = got
        if isinstance(msg, Pong) and msg.seq == rank and msg.payload == f"hello rank {rank}":
            answered.add(rank)
    print(f"[controller] run {ctl.run_id}: {ctl.roles.world_size} ranks registered "
          f"({ctl.roles.num_trainer} trainer, {ctl.roles.num_rollout} rollout)", flush=True)
    for rank in ctl.all_ranks:
        info = ctl.infos[rank]
        print(f"[controller]   {ctl.describe(rank)}: model {info.get('model', '?')} "
              f"{info.get('params', 0) / 1e6:.1f}M params, loaded in {info.get('load_s', 0):.1f}s", flush=True)
    print("[controller] smoke run OK: every rank registered, loaded the model and answered", flush=True)
    # STALEFLOW_SMOKE_HOLD_S keeps the run alive (with liveness checks) so tests can kill a rank.
    hold_until = time.monotonic() + float(os.environ.get("STALEFLOW_SMOKE_HOLD_S", "0"))
    while time.monotonic() < hold_until:
        ctl.recv(min(0.2, max(0.0, hold_until - time.monotonic())))


def controller_main(cfg, run_id: str, world_size: int, parent_pid: int, run_dir: str = "",
                    job: Callable | None = None) -> None:
    """Entry point of the controller process (multiprocessing spawn target). Exits 0 on success."""
    roles = Roles(world_size, cfg.rollout.ranks)
    ctl = Controller(run_id=run_id, roles=roles, parent_pid=parent_pid, run_dir=run_dir)

    def on_signal(signum, _frame):
        if not ctl.stop_requested:
            ctl.stop_requested = f"stopped by signal {signal.Signals(signum).name}"
            ctl.stop_at = time.monotonic()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        ctl.wait_ready(timeout_s=float(os.environ.get("STALEFLOW_READY_TIMEOUT", "600")))
        if job is None:
            job = smoke_job if cfg.smoke else _training_job()
        job(ctl, cfg)
        ctl.shutdown("run finished", ok=True)
    except RankDied as e:
        print(f"staleflow: {e}; stopping the run", file=sys.stderr, flush=True)
        ctl.shutdown(str(e), ok=False, wait_s=3)
        code = 1
    except KeyboardInterrupt as e:
        print(f"staleflow: {e or 'interrupted'}; stopping the run", file=sys.stderr, flush=True)
        ctl.shutdown("interrupted", ok=False, wait_s=3)
        code = 130
    except Exception as e:  # a bug or bad input inside the job: report it in one line, stop everyone
        print(f"staleflow: controller error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        ctl.shutdown(f"controller error: {e}", ok=False, wait_s=3)
        code = 1
    finally:
        ctl.close()
    sys.exit(code)


def _training_job():
    from staleflow.launch.runtime import training_job

    return training_job
