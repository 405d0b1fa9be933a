"""A stop signal reaches every rank at once (torchrun forwards it to the whole group): rollout
ranks may exit before the controller has saved its emergency checkpoint. The hub must then treat
a gone rollout rank as having left, not as the failure that stops the save; a gone trainer rank
still stops it (the save needs every trainer rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from staleflow.launch.cleanup import remove_run_folder
from staleflow.launch.hub import Controller, RankDied
from staleflow.launch.roles import Roles


@pytest.fixture
def ctl():
    c = Controller(run_id=uuid.uuid4().hex[:10], roles=Roles(3, 2), parent_pid=os.getppid())
    yield c
    c.close()
    remove_run_folder(c.run_id)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _register(ctl: Controller, dead_rank: int) -> None:
    ctl.pids = {0: os.getpid(), 1: os.getpid(), 2: os.getpid()}  # ranks 1 and 2 are rollout ranks
    ctl.pids[dead_rank] = _dead_pid()


def test_hub_a_dead_rollout_rank_stops_a_running_job(ctl):
    _register(ctl, 1)
    with pytest.raises(RankDied, match=r"rank 1 \(rollout instance 0, pid \d+\) died unexpectedly"):
        ctl.recv(0.2)


@pytest.mark.parametrize("state", ["signal", "emergency save"])
def test_hub_a_rollout_rank_gone_after_a_stop_signal_has_left_and_does_not_fail_the_save(ctl, state):
    _register(ctl, 2)
    if state == "signal":
        ctl.stop_requested, ctl.stop_at, ctl.grace_s = "stopped by signal SIGTERM", time.monotonic(), 30.0
    else:
        ctl.grace_s = 20.0
    assert ctl.recv(0.2) is None  # no RankDied: the save may go on with the trainer ranks
    assert 2 in ctl.left


def test_hub_a_trainer_rank_gone_during_the_emergency_save_still_fails_it(ctl):
    _register(ctl, 0)
    ctl.stop_requested, ctl.stop_at, ctl.grace_s = "stopped by signal SIGTERM", time.monotonic(), 30.0
    with pytest.raises(RankDied, match=r"rank 0 \(trainer.*died unexpectedly"):
        ctl.recv(0.2)
