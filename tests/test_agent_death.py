"""A killed torchrun agent takes its whole run with it, and a run folder has one writer at a time.

The real system (launch.sh, tiny preset): while it trains, `staleflow check --resume` on its folder
is refused in one line naming the live pid (run.lock); then `kill -KILL` of the torchrun agent must
leave no rank, controller or reward worker running and no /dev/shm segment behind (launch/lifeline.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest
from test_faults import _env, _leaked, _shm, _titled, _wait_for_step, launch
from test_launch import _kill_group, _tagged_processes, _wait_gone

from staleflow.config import ConfigError
from staleflow.runfolder import lock as run_lock

AGENT_DEATH_BOUND_S = 120  # SIGTERM to every rank; the trainer may take its 20 s grace to save


def _agent(tag: str) -> int:
    pids = [
        p for p in _tagged_processes(tag) if b"staleflow.launch.torchrun" in open(f"/proc/{p}/cmdline", "rb").read()
    ]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.mark.slow
def test_agent_death_stops_every_process_and_frees_shm_and_run_lock_refuses_a_second_writer(tmp_path):
    tag, shm_before = uuid.uuid4().hex, _shm()
    proc = launch(tag, tmp_path, "run", "--steps", "400", "--checkpoint.every", "2")
    run = tmp_path / "run"
    try:
        _wait_for_step(run, 1, proc)
        rank0 = _titled(tag, "staleflow[trainer 0]")
        assert len(rank0) == 1 and (run / "run.lock").read_text().strip() == str(rank0[0])
        # a second writer: refused before anything starts, naming the live pid
        check = subprocess.run(
            [sys.executable, "-m", "staleflow", "check", "--preset", "tiny", "--resume", str(run)],
            capture_output=True,
            text=True,
            env=_env(uuid.uuid4().hex),
            timeout=120,
        )
        assert check.returncode == 2, check.stderr
        lines = check.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {rank0[0]}" in lines[0] and "live run" in lines[0], check.stderr
        children = [p for p in _tagged_processes(tag) if p != proc.pid]
        assert _titled(tag, "staleflow[controller]") and _titled(tag, "staleflow[reward 0]")
        os.kill(_agent(tag), signal.SIGKILL)
        proc.wait(timeout=60)
        left = _wait_gone(tag, AGENT_DEATH_BOUND_S)
        assert not left, f"still running {AGENT_DEATH_BOUND_S} s after the agent died: {left} (of {children})"
        assert not (_shm() - shm_before), f"segments left: {_shm() - shm_before}"
        assert not _leaked(shm_before)
        run_lock.lock_run_dir(str(run))  # the dead run's lock is taken over
        run_lock.release_run_dir(str(run))
    finally:
        _kill_group(proc)
        for pid in _tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; from staleflow.runfolder import lock as run_lock; "
            "run_lock.lock_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(60)",
            str(run),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for attempt in (run_lock.lock_run_dir, run_lock.check_unlocked):
            with pytest.raises(ConfigError) as info:
                attempt(str(run))
            assert f"pid {holder.pid}" in str(info.value) and "\n" not in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    assert (run / "run.lock").read_text().strip() == str(holder.pid)  # a stale lock file of a dead pid ...
    run_lock.check_unlocked(str(run))
    run_lock.lock_run_dir(str(run))  # ... is taken over
    try:
        assert (run / "run.lock").read_text().strip() == str(os.getpid())
    finally:
        run_lock.release_run_dir(str(run))


def test_run_lock_refuses_a_symlinked_lock_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="run.lock"):
        run_lock.lock_run_dir(str(run))
    assert not (tmp_path / "elsewhere").exists()
