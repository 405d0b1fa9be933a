"""Faults and resume with trainer ranks on two nodes (two torchrun agents on this machine).

The torchrun agent of node 1 (trainer rank 2 and the rollout rank) is SIGKILLed mid-run. As on one node
(tests/test_agent_death.py, the chaos kinds agent-killed and kill-rollout), its ranks stop with it, the
controller names the lost rank and its node, saves a checkpoint while the trainer group still answers
(a trainer rank keeps serving for TERM_GRACE_S after its stop signal), both agents exit non-zero, and
nothing of the run is left: no process, no /dev/shm segment. ``--resume`` given to both agents then
continues from the newest checkpoint, every node reading its own ranks' shards, and every buffer is
trained exactly once (metrics/audit.py). The finished run's checkpoint then resumes on one node: its
state files hold rows, so four trainer ranks reshard the three ranks' files (one line says so).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
from test_faults import _leaked, _shm
from test_launch import _wait_gone
from test_multinode_e2e import _rows, agents, finish
from test_multinode_trainer import _one_node

from staleflow.metrics.audit import audit_run

pytestmark = pytest.mark.slow

STEPS = 8


def _wait_rows(run, procs, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").is_file() and len([r for r in _rows(run) if "eval_n" not in r]) >= n:
            return
        assert all(p.poll() is None for p in procs), "the run ended early"
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def test_multinode_resume_after_a_node_agent_is_killed_trains_every_buffer_once_then_reshards_on_one_node(tmp_path):
    tag, shm_before = uuid.uuid4().hex, _shm()
    run = tmp_path / "run"
    flags = ("--rollout.ranks", "1", "--checkpoint.every", "2")
    procs = agents(tag, tmp_path, "run", "--steps", str(STEPS), *flags, launcher="staleflow.launch.torchrun")
    try:
        _wait_rows(run, procs, 2)
        os.kill(procs[1].pid, signal.SIGKILL)  # node 1's agent: trainer rank 2 and the rollout rank go with it
        out0, _ = finish(procs, timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0 and procs[1].returncode == -signal.SIGKILL
    assert "(rollout instance 0, node 1" in out0 or "(trainer, node 1" in out0, out0[-3000:]
    assert "saved version" in out0, out0[-3000:]  # the emergency save, with trainer rank 2 still answering
    assert _wait_gone(tag, timeout=90) == []
    assert _leaked(shm_before) == set()
    done = len([r for r in _rows(run) if "eval_n" not in r])
    assert done < STEPS

    tag = uuid.uuid4().hex
    procs = agents(tag, tmp_path, "again", "--resume", str(run), *flags, launcher="staleflow.launch.torchrun")
    out0, out1 = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], out0[-3000:] + out1[-3000:]
    assert "trainers (FSDP over all) and Parameter Server pieces on nodes 0, 1" in out0
    rows = [r for r in _rows(run) if "eval_n" not in r]
    assert rows[-1]["step"] == STEPS - 1
    report = audit_run(run, steps=STEPS, batch_size=4, group_size=4, eta=1)
    assert report.ok, report
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["nodes"] == 2 and manifest["files"]["rank_2.safetensors"]["node"] == 1
    assert _wait_gone(tag) == []
    assert _leaked(shm_before) == set()

    # the same run on one node of 5 ranks: 4 trainer ranks read the two-node checkpoint's 3 rows files
    one = finish([_one_node(tag, tmp_path, "one", "--resume", str(run), "--steps", str(STEPS + 2), *flags, nproc=5)])
    assert (
        f"checkpoint step_{STEPS:08d} was written by 3 trainer rank(s) on 2 node(s) (fsdp); resharded onto 4 "
        "rank(s) on 1 node(s) (fsdp)" in one[0]
    ), one[0][-3000:]
    rows = [r for r in _rows(run) if "eval_n" not in r]
    assert rows[-1]["step"] == STEPS + 1
    report = audit_run(run, steps=STEPS + 2, batch_size=4, group_size=4, eta=1)
    assert report.ok, report
    assert _wait_gone(tag) == []
