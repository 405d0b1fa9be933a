"""A stop signal reaches every rank at once (torchrun forwards it to the whole group): rollout
ranks may exit before the controller has saved its emergency checkpoint, and their Goodbye may
still be unread when the controller sees their process gone. Such a rank left in order: the save
goes on. A rank gone without a Goodbye (killed, crashed) is still the cause that stops the run,
even when torchrun's signal reached the controller first, and a gone trainer rank still fails
the save (it needs every trainer rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from staleflow.cluster.roles import Roles
from staleflow.control.hub import Hub, RankDied
from staleflow.control.messages import Goodbye
from staleflow.control.sockets import ControlClient, control_address
from staleflow.runfolder.scratch import remove_run_folder


@pytest.fixture
def ctl():
    c = Hub(run_id=uuid.uuid4().hex[:10], roles=Roles(3, 2), parent_pid=os.getppid())
    yield c
    c.close()
    remove_run_folder(c.run_id)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _gone(ctl: Hub, rank: int, goodbye: bool) -> None:
    """Ranks 1 and 2 are rollout ranks; ``rank``'s process is gone, after a Goodbye or not."""
    ctl.pids = {0: os.getpid(), 1: os.getpid(), 2: os.getpid()}
    ctl.pids[rank] = _dead_pid()
    if goodbye:
        c = ControlClient(control_address(ctl.run_id), rank)
        c.send(Goodbye(rank=rank, ok=False, reason="interrupted (signal SIGTERM)"))
        c.close()  # delivered before close returns, as when a rank exits


def _signalled(ctl: Hub) -> None:
    ctl.stop_requested, ctl.stop_at, ctl.grace_s = "stopped by signal SIGTERM", time.monotonic(), 30.0


def test_hub_a_rollout_rank_gone_without_goodbye_is_the_cause_even_after_a_signal(ctl):
    _gone(ctl, 1, goodbye=False)
    with pytest.raises(RankDied, match=r"rank 1 \(rollout instance 0, pid \d+\) died unexpectedly"):
        ctl.recv(0.2)
    _signalled(ctl)  # torchrun signals the others after a rank died: the dead rank stays the cause
    with pytest.raises(RankDied, match=r"rank 1 .* died unexpectedly"):
        ctl.recv(0.2)


@pytest.mark.parametrize("state", ["signal", "emergency save"])
def test_hub_a_rollout_rank_that_said_goodbye_has_left_and_does_not_fail_the_save(ctl, state):
    _gone(ctl, 2, goodbye=True)
    if state == "signal":
        _signalled(ctl)
    else:
        ctl.grace_s = 20.0
    assert ctl.recv(0.5) is None  # no RankDied: the save may go on with the trainer ranks
    assert 2 in ctl.left


def test_hub_a_rollout_rank_leaving_on_its_own_signal_still_stops_a_running_job(ctl):
    _gone(ctl, 2, goodbye=True)
    with pytest.raises(RankDied, match=r"rank 2 .* left: interrupted"):
        ctl.recv(0.5)


def test_hub_a_trainer_rank_gone_during_the_emergency_save_still_fails_it(ctl):
    _gone(ctl, 0, goodbye=False)
    _signalled(ctl)
    with pytest.raises(RankDied, match=r"rank 0 \(trainer.*died unexpectedly"):
        ctl.recv(0.2)
