"""The launcher for real: torchrun with 3 processes (1 trainer, 2 rollout) + the controller.

Checks registration, message exchange, clean shutdown (no processes, no run files, no
shared-memory segments left), and that a killed rank ends the run non-zero naming that rank.
"""

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from staleflow.control.messages import Ping, Register, decode, encode

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3"]


def test_messages_round_trip_without_pickle():
    msg = Register(rank=2, role="rollout", pid=123, host="h", info={"params": 7})
    data = encode(msg)
    assert b"\x80" not in data[:2]  # msgpack, not a pickle protocol header
    assert decode(data) == msg
    assert decode(encode(Ping(rank=1, seq=5, payload="x"))) == Ping(rank=1, seq=5, payload="x")


def _tagged_processes(tag: str) -> list[int]:
    """Pids of live processes whose environment carries our tag (the run's processes)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"STALEFLOW_TEST_TAG={tag}".encode() in f.read():
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().split(")")[-1].split()[0] != "Z":
                            found.append(int(pid))
        except OSError:
            continue
    return found


def _run_files(run_id: str) -> list[str]:
    shm = [f for f in os.listdir("/dev/shm") if run_id in f]
    tmp = [f for f in os.listdir("/tmp") if f == f"staleflow-run-{run_id}"]
    return shm + tmp


def _start(tag: str, extra_env: dict, *args):
    env = dict(os.environ, STALEFLOW_TEST_TAG=tag, **extra_env)
    return subprocess.Popen(
        [*TORCHRUN, "-m", "staleflow", "train", "--preset", "tiny", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _read_until(proc, done, timeout: float) -> str:
    """The process's stdout lines up to and including the first one for which done(line) holds
    (or until EOF / timeout), joined."""
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if done(line):
            break
    return "".join(lines)


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_gone(tag: str, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _tagged_processes(tag)
        if not left:
            return []
        time.sleep(0.2)
    return _tagged_processes(tag)


@pytest.mark.slow
def test_smoke_run_registers_every_rank_and_shuts_down_clean():
    tag = uuid.uuid4().hex
    proc = _start(tag, {}, "--smoke")
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, out
    run_id = re.search(r"\[controller\] run (\w+):", out).group(1)
    assert "3 ranks registered (1 trainer, 2 rollout)" in out
    for rank, role in [(0, "trainer"), (1, "rollout instance 0"), (2, "rollout instance 1")]:
        assert re.search(rf"rank {rank} \({role}, pid \d+\): model tiny-llama [\d.]+M params", out), out
    assert "smoke run OK" in out
    assert _wait_gone(tag) == []
    assert _run_files(run_id) == []


@pytest.mark.slow
def test_killed_rank_ends_the_run_nonzero_naming_it():
    tag = uuid.uuid4().hex
    proc = _start(tag, {"STALEFLOW_SMOKE_HOLD_S": "120"}, "--smoke")
    victim_line = re.compile(r"rank 2 \(rollout instance 1, pid (\d+)\)")
    try:
        out = _read_until(proc, victim_line.search, 240)
        m = victim_line.search(out)
        assert m, out
        run_id = re.search(r"\[controller\] run (\w+):", out).group(1)
        os.kill(int(m.group(1)), signal.SIGKILL)
        rest, _ = proc.communicate(timeout=120)
        out += rest
    finally:
        _kill_group(proc)
    assert proc.returncode != 0, out
    assert re.search(r"staleflow: rank 2 \(rollout instance 1, pid \d+\) died unexpectedly", out), out
    assert _wait_gone(tag) == []
    assert _run_files(run_id) == []


def test_cleanup_removes_only_claimed_folders_of_dead_runs(tmp_path, monkeypatch):
    import tempfile

    from staleflow.runfolder import scratch as cleanup

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / "staleflow-run-dead1"
    dead.mkdir()
    (dead / "owner.pid").write_text("999999999")
    live = tmp_path / "staleflow-run-live1"
    live.mkdir()
    (live / "owner.pid").write_text(str(os.getpid()))
    foreign = tmp_path / "staleflow-run-foreign"  # no pid file: someone else's, never deleted
    foreign.mkdir()
    other = tmp_path / "staleflow-bench-x"
    other.mkdir()
    removed = cleanup.cleanup_stale_run_files()
    assert str(dead) in removed
    assert not dead.exists() and live.exists() and foreign.exists() and other.exists()


def test_world_too_small_is_a_config_error():
    tag = uuid.uuid4().hex
    env = dict(os.environ, STALEFLOW_TEST_TAG=tag)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "-m",
            "staleflow",
            "train",
            "--preset",
            "tiny",
            "--smoke",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode != 0
    assert "world size 1 is too small for --rollout.ranks=2" in res.stdout + res.stderr


@pytest.mark.slow
def test_ctrl_c_stops_every_process_cleanly():
    """SIGINT to the whole process group (what a terminal's Ctrl-C does): all exit, nothing is left."""
    tag = uuid.uuid4().hex
    proc = _start(tag, {"STALEFLOW_SMOKE_HOLD_S": "120"}, "--smoke")
    try:
        out = _read_until(proc, lambda line: "smoke run OK" in line, 240)
        assert "smoke run OK" in out, out
        run_id = re.search(r"\[controller\] run (\w+):", out).group(1)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        out += rest
    finally:
        _kill_group(proc)
    assert proc.returncode != 0, out
    assert "interrupted" in out or "SIGINT" in out or "SIGTERM" in out, out
    assert _wait_gone(tag) == []
    assert _run_files(run_id) == []
