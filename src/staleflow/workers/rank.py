"""A rank's side of the control plane: its context, receiving with liveness checks, signals.

    ctx = RankContext(cfg, roles, rank, run_id, client, ...)
    msg = ctx.recv(timeout_s)      # next controller message; RunStopped when the run is over

Nothing waits forever. ``recv`` raises RunStopped when the controller said Shutdown(ok=False),
when its process is gone (same node: its pid), or when it has sent nothing, not even a
heartbeat, for HEARTBEAT_TIMEOUT_S. SIGTERM and SIGINT (torchrun stops every rank on Ctrl-C, on
its own SIGTERM, or when one rank dies) are deferred while the rank loop runs: a trainer rank
keeps serving for TERM_GRACE_S so the controller can still have it save a checkpoint; a rollout
rank stops at once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from staleflow.cluster.roles import Roles
from staleflow.config import RunConfig
from staleflow.control.messages import Heartbeat, Shutdown
from staleflow.control.sockets import ControlClient
from staleflow.runfolder.scratch import pid_alive

HEARTBEAT_TIMEOUT_S = float(os.environ.get("STALEFLOW_HEARTBEAT_TIMEOUT_S", "60"))
TERM_GRACE_S = 20.0  # torchrun SIGKILLs 30 s after its SIGTERM
_TERM: dict = {"defer": False, "at": None, "signum": None, "forward": None}


class RunStopped(RuntimeError):
    """The controller ended the run (ok=False), or disappeared. ``restart``: an elastic restart may
    fix the cause (a rank or the controller died), as opposed to a signal or bad input."""

    def __init__(self, message: str, restart: bool = True, controller_hung: bool = False):
        super().__init__(message)
        self.restart = restart
        self.controller_hung = controller_hung  # alive but silent (SIGSTOP, wedged): rank 0 kills it at once


@dataclass
class RankContext:
    """What a rank's loop needs: its identity, the config, the control client and process groups."""

    cfg: RunConfig
    roles: Roles
    rank: int
    run_id: str
    client: ControlClient
    run_dir: str = ""
    trainer_group: object = None
    replicas: object = None
    """HSDP across nodes (--cluster.sharding hsdp): this trainer rank's train.parallelize.Replicas, else None."""
    device: str = "cpu"
    """This rank's device (launch/dist.py): cuda:LOCAL_RANK on a GPU node, else cpu."""
    controller_pid: int = 0
    """The controller's pid when it runs on this node (0: another node, heartbeats only)."""
    net: object = None
    """This rank's cross-node plane (cluster/netplane.py) in a multi-node run, else None."""
    resume_from: str = ""
    """The checkpoint folder to load (trainer ranks), chosen by rank 0."""
    progress: Callable[[], tuple[int, bool]] = lambda: (0, False)
    """(progress counter, busy) of this rank's worker, read by its pulse thread (workers/pulse.py)."""
    _last_heard: float = field(default_factory=time.monotonic)
    _last_pid_check: float = 0.0

    @property
    def role(self) -> str:
        return self.roles.role(self.rank)

    def _check_controller(self, now: float) -> None:
        if self.controller_pid and now - self._last_pid_check > 0.5:
            self._last_pid_check = now
            if not pid_alive(self.controller_pid):
                raise RunStopped(f"the controller (pid {self.controller_pid}) died")
        if now - self._last_heard > HEARTBEAT_TIMEOUT_S:
            raise RunStopped(
                f"the controller sent nothing for {HEARTBEAT_TIMEOUT_S:.0f} s (hung or unreachable)",
                controller_hung=True,
            )

    def recv(self, timeout_s: float):
        """Next controller message other than a heartbeat (None after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if _TERM["at"] is not None:
                grace = TERM_GRACE_S if self.role == "trainer" else 0.0
                if now - _TERM["at"] > grace:
                    raise KeyboardInterrupt(f"signal {signal.Signals(_TERM['signum']).name}")
                deadline = min(deadline, _TERM["at"] + grace)
            msg = self.client.recv(max(0.0, min(deadline - now, 0.5)))
            if msg is not None:
                self._last_heard = time.monotonic()
                if isinstance(msg, Heartbeat):
                    continue
                if isinstance(msg, Shutdown) and not msg.ok:
                    raise RunStopped(msg.reason, restart=msg.restart)
                return msg
            # Only after the queue is empty: a rank busy for minutes (a training step) finds the
            # heartbeats sent meanwhile waiting in its socket, not a silent controller.
            self._check_controller(time.monotonic())
            if time.monotonic() >= deadline:
                return None


def on_stop_signal(signum, _frame):
    """Before the rank loop: stop at once. In the loop: note it; RankContext.recv stops (after a
    grace for trainer ranks). Rank 0 passes the signal on to its controller, which then saves a
    checkpoint and stops the run (exit 128 + signal number)."""
    forward = _TERM["forward"]
    if forward is not None:
        try:
            os.kill(forward, signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)
        except ProcessLookupError:
            pass
    if not _TERM["defer"]:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
    if _TERM["at"] is None:
        _TERM["at"], _TERM["signum"] = time.monotonic(), signum


def install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, on_stop_signal)
    signal.signal(signal.SIGINT, on_stop_signal)


def defer_signals(forward_to: int | None = None) -> None:
    """From now on a stop signal is handled by the rank loop (and forwarded to the controller)."""
    _TERM["defer"] = True
    _TERM["forward"] = forward_to


def set_title(title: str) -> None:
    """A readable process title (ps, /proc/<pid>/cmdline): staleflow[trainer 0] etc.

    SPT_NOENV keeps /proc/<pid>/environ intact (setproctitle would otherwise reuse its memory for
    a long title); our command lines are long enough for these titles."""
    os.environ["SPT_NOENV"] = "1"
    try:
        import setproctitle
    except ImportError:  # a declared dependency; a fork without it only loses the titles
        return
    setproctitle.setproctitle(title)
