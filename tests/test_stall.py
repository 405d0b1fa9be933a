"""A stuck rank is caught: one that sends nothing (SIGSTOP stops its pulse thread with it) or has
work and makes no progress for the stall limit is named in one line, killed, and the run
restarts from its newest checkpoint (a pid that is alive is not a rank that works)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from test_faults import _kill_group, _titled, _wait_for_step, launch

from staleflow.cluster.roles import Roles
from staleflow.config import FaultConfig
from staleflow.control.hub import Hub, RankDied
from staleflow.control.messages import Heartbeat
from staleflow.control.sockets import ControlClient, control_address
from staleflow.metrics.audit import audit_run
from staleflow.runfolder.scratch import remove_run_folder
from staleflow.workers.pulse import Pulse


@pytest.fixture
def hub():
    h = Hub(run_id=uuid.uuid4().hex[:10], roles=Roles(3, 2), parent_pid=os.getppid())
    yield h
    h.close()
    remove_run_folder(h.run_id)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _beat(hub: Hub, rank: int, progress: int, busy: bool) -> None:
    c = ControlClient(control_address(hub.run_id), rank, pulse=True)
    c.send(Heartbeat(rank=rank, progress=progress, busy=busy))
    c.close()


def _until_stuck(hub: Hub, seconds: float, beat=None) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if beat is not None:
            beat()
        try:
            got = hub.recv(0.2)
        except RankDied as e:
            return str(e)
        assert got is None, f"a pulse reached the job: {got}"
    return ""


def test_stall_a_busy_rank_without_progress_is_named_and_killed(hub):
    victim = _sleeper()
    try:
        hub.pids = {0: os.getpid(), 1: victim.pid, 2: os.getpid()}
        hub.stall_s = 1.5
        assert _until_stuck(hub, 1.0, beat=lambda: _beat(hub, 1, 7, busy=False)) == ""  # idle: no progress due
        err = _until_stuck(hub, 6.0, beat=lambda: _beat(hub, 1, 7, busy=True))
        assert "rank 1 (rollout instance 0" in err and "made no progress for" in err and "while it had work" in err
        assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        victim.kill()


def test_stall_a_silent_rank_is_named_and_a_progressing_one_is_not(hub):
    victim = _sleeper()
    try:
        hub.pids = {0: os.getpid(), 1: os.getpid(), 2: victim.pid}
        hub.stall_s = 1.5
        counter = iter(range(10**6))
        assert (
            _until_stuck(
                hub, 3.0, beat=lambda: (_beat(hub, 1, next(counter), True), _beat(hub, 2, next(counter), True))
            )
            == ""
        )
        err = _until_stuck(hub, 6.0, beat=lambda: _beat(hub, 1, next(counter), True))  # rank 2 falls silent
        assert "rank 2 (rollout instance 1" in err and "sent nothing for" in err and "--fault.stall-s" in err
        assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        victim.kill()


def test_stall_limit_is_sized_from_the_longest_step_with_a_floor():
    assert FaultConfig().limit(0.0) == 300.0 and FaultConfig().limit(120.0) == 480.0
    assert FaultConfig(stall_s=20.0).limit(120.0) == 20.0


def test_stall_pulse_sends_its_progress_each_beat(hub):
    state = {"n": 0}

    def progress():
        state["n"] += 3
        return state["n"], True

    pulse = Pulse(lambda: ControlClient(control_address(hub.run_id), 1, pulse=True), 1, progress, every_s=0.1).start()
    try:
        time.sleep(1.0)
        hub.recv(0.2)
    finally:
        pulse.stop()
    assert pulse.beats >= 3
    seen = hub._progress[1][0]  # the newest counter the hub read: one of the values the rank reported
    assert seen > 0 and seen % 3 == 0 and seen <= state["n"]


@pytest.mark.slow
def test_stall_a_stopped_rollout_rank_is_caught_and_the_run_recovers(tmp_path):
    """SIGSTOP (not SIGKILL): the process is alive to pid checks, but its pulse stops."""
    tag = uuid.uuid4().hex
    proc = launch(tag, tmp_path, "run", "--steps", "10", "--checkpoint.every", "3", "--fault.stall-s", "15")
    try:
        _wait_for_step(tmp_path / "run", 4, proc)
        pids = _titled(tag, "staleflow[rollout 1]")
        assert pids, "no rollout rank"
        os.kill(pids[0], signal.SIGSTOP)
        out, _ = proc.communicate(timeout=600)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    # a stopped process neither pulses nor progresses: either check may fire first
    assert "rank 2 (rollout instance 1" in out and ("sent nothing for" in out or "made no progress" in out), out[-3000:]
    assert "elastic restart 1" in out, out[-3000:]
    report = audit_run(tmp_path / "run", steps=10, batch_size=4, group_size=4, eta=1)
    assert report.ok, report.problems
