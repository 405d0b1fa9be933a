"""Every rank dies with its torchrun agent.

torchrun starts its workers in new sessions: a ``kill -KILL`` of the agent (or of launch.sh's
process group) leaves them training, writing the run folder and holding /dev/shm. ``tie_to_agent()``
(first thing a rank does) closes that in two ways:

  - ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (Linux): the kernel sends SIGTERM when the agent (the
    rank's parent) exits, however it dies. A rank treats it as torchrun's own SIGTERM: rank 0 passes
    it on to its controller, which saves a checkpoint when it can; the rollout ranks stop at once.
  - a watcher thread on the agent: once the rank's parent is no longer the agent it sends that
    SIGTERM itself (a system without prctl), and if the rank is still alive ORPHAN_GRACE_S later
    (wedged in a collective, nobody left to SIGKILL it) it exits (os._exit): the shared memory of
    such a rank is removed by the next start (runfolder/scratch.py: its creator is dead).
The controller follows rank 0 (it watches its parent, control/hub.py) and reward workers follow the
controller (PR_SET_PDEATHSIG, reward/pool.py).

The agent is ``$STALEFLOW_AGENT_PID`` (set by ``staleflow.launch.torchrun``) or, under a plain
torchrun (``TORCHELASTIC_RUN_ID`` set), the rank's parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = float(os.environ.get("STALEFLOW_ORPHAN_GRACE_S", "45"))
"""After the agent died: how long a rank may take to stop by itself (the trainer keeps 20 s for a save)."""


def agent_pid() -> int:
    """The torchrun agent this process was started by, or 0 when there is none."""
    pid = os.environ.get("STALEFLOW_AGENT_PID", "")
    if pid.isdigit():
        return int(pid)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.getppid()
    return 0


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` when this process's parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _orphaned(agent: int, armed: bool) -> None:
    while os.getppid() == agent:
        time.sleep(0.5)
    print(
        f"staleflow: the torchrun agent (pid {agent}) is gone; stopping this rank (pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )
    if not armed:  # the kernel has not sent it: the same path as torchrun's own SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(1)


def tie_to_agent() -> int:
    """Make this rank die with its agent; returns the agent's pid (0: not started by an agent).
    A rank whose agent is already gone exits at once (SystemExit 1)."""
    agent = agent_pid()
    if agent <= 1:
        return 0
    armed = set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != agent:  # died before the signal was armed, or not our parent at all
        if os.environ.get("STALEFLOW_AGENT_PID") and not _alive(agent):
            print(f"staleflow: the torchrun agent (pid {agent}) is gone; not starting", file=sys.stderr, flush=True)
            raise SystemExit(1)
        return 0
    threading.Thread(target=_orphaned, args=(agent, armed), name="staleflow-lifeline", daemon=True).start()
    return agent


def _alive(pid: int) -> bool:
    from staleflow.runfolder.scratch import pid_alive

    return pid_alive(pid)
