"""Data plane under real torchrun + gloo (3 processes): concurrent pulls and a ring stress test.

Each test launches ``tests/servers_selftest.py`` (see its docstring for what every rank checks)
in its own process group, kills the whole group on a timeout, and checks every rank's JSON
report and that no shared-memory segment of the run is left in /dev/shm.
"""

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from staleflow.servers import list_segments

pytestmark = pytest.mark.slow


def _torchrun(args: list[str], timeout: float = 240) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=3",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "servers_selftest.py"),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout}s:\n{out[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reports = [json.loads(line) for line in out.splitlines() if line.startswith('{"rank"')]
    assert proc.returncode == 0 and len(reports) == 3 and all(r["ok"] for r in reports), out[-3000:]
    return sorted(reports, key=lambda r: r["rank"])


def test_one_trainer_pushes_while_two_readers_pull():
    run = "m" + uuid.uuid4().hex[:10]
    leader, *readers = _torchrun(["param", "--run-id", run, "--versions", "200"])
    assert leader["pushed"] == 200
    for r in readers:  # each pulled (and verified bit for bit) several versions while pushes ran
        assert r["pulled"] >= 2 and r["increasing"]
    assert list_segments(f"staleflow-{run}") == []


def test_ring_stress_random_sizes_with_back_pressure(tmp_path):
    run = "m" + uuid.uuid4().hex[:10]
    producer, *readers = _torchrun(["ring", "--run-id", run, "--ipc-dir", str(tmp_path), "--records", "200"])
    assert producer["written"] == producer["freed"] == 200
    assert producer["ring_full"] > 0  # back-pressure happened and resolved (every record was then written)
    assert sum(r["read"] for r in readers) == 200
    assert list_segments(f"staleflow-{run}") == []
    assert os.listdir(tmp_path) == []


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_slots_under_torchrun():
    run = "m" + uuid.uuid4().hex[:10]
    leader, *readers = _torchrun(["param", "--run-id", run, "--versions", "100", "--device", "cuda"])
    assert leader["pushed"] == 100 and all(r["pulled"] >= 2 for r in readers)
    assert list_segments(f"staleflow-{run}") == []
