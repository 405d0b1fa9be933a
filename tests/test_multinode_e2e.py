"""Two torchrun agents on one machine are two nodes (node identity is torchrun's GROUP_RANK), so
every cross-node path runs here: the CURVE TCP control plane, records shipped to the trainers'
node, weights pulled over gloo, partial records fetched across nodes, and a rollout rank dying on
the node without the controller."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_faults import _leaked, _listening_on, _shm, _titled
from test_launch import _kill_group, _tagged_processes, _wait_gone

from staleflow.metrics.audit import audit_run

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TINY = ["--preset", "tiny", "--log.no-progress", "--log.no-plot", "--reward.fn", "e2e_rewards:text_length"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agents(
    tag: str,
    run_dir: Path,
    name: str,
    *args: str,
    nproc: int = 2,
    launcher: str = "torch.distributed.run",
    c10d: bool = False,
) -> list[subprocess.Popen]:
    """`torchrun --nnodes 2 --node-rank 0|1 ... --master-addr 127.0.0.1 --master-port P`, twice
    (``launcher`` staleflow.launch.torchrun: our wrapper, whose stores listen on that address only;
    ``c10d``: the c10d rendezvous instead, which assigns the node ranks itself)."""
    port = _free_port()
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, STALEFLOW_TEST_TAG=tag, PYTHONPATH=path)
    procs = []
    for node in (0, 1):
        rdzv = (
            [
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                tag,
                "--local-addr",
                "127.0.0.1",
            ]
            if c10d
            else ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        )
        cmd = [
            sys.executable,
            "-m",
            launcher,
            "--nnodes",
            "2",
            "--nproc-per-node",
            str(nproc),
            *rdzv,
            "-m",
            "staleflow",
            "train",
            *TINY,
            "--log.run-dir",
            str(run_dir),
            "--log.name",
            name,
            *args,
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
            )
        )
    return procs


def finish(procs, timeout: float = 600) -> list[str]:
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            _kill_group(p)
    return outs


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _listening(tag: str, ours_only: bool) -> list[str]:
    """Local addresses (hex, /proc/net format) of the TCP sockets the run's processes listen on
    (``ours_only``: the ranks and the controller, not the torchrun agents)."""
    pids = _tagged_processes(tag)
    if ours_only:
        pids = [p for p in pids if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"staleflow[")]
    return _listening_on(pids)


def test_multinode_two_agents_train_with_records_and_weights_crossing_nodes(tmp_path):
    """The acceptance run: 2 nodes x 2 ranks, trainer ranks 0-1 on node 0, rollout ranks 2-3 on node 1."""
    tag, shm_before = uuid.uuid4().hex, _shm()
    run = tmp_path / "run"
    procs = agents(tag, tmp_path, "run", "--steps", "6", "--rollout.ranks", "2")
    listening = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if (run / "metrics.jsonl").is_file() and _rows(run):
            listening = _listening(tag, ours_only=True)  # plain torchrun's own store listens everywhere
            break
        time.sleep(0.2)
    out0, out1 = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], out0[-3000:] + out1[-3000:]
    assert "staleflow: 4 ranks on 2 nodes (2 trainer, 2 rollout)" in out0
    assert "node 1 [127.0.0.1]: rank 2 rollout 0, rank 3 rollout 1" in out0
    last = [r for r in _rows(run) if "eval_n" not in r][-1]
    assert last["step"] == 5
    assert last["cross_node_records"] > 0 and last["cross_node_record_bytes"] > 0
    assert last["cross_node_pull_bytes"] > 0
    assert set(last["pull_s_by_instance"]) <= {"0", "1"}
    assert any(r.get("pull_s_by_instance") for r in _rows(run))
    assert audit_run(run, steps=6, batch_size=4, group_size=4, eta=1).ok
    # The controller's and servers' TCP sockets listen on the interface towards the rendezvous
    # host (here loopback), never on every interface.
    assert listening and all(a in ("0100007F", "00000000000000000000000001000000") for a in listening), listening
    assert _wait_gone(tag) == []
    assert _leaked(shm_before) == set()  # rings, mirrors and slots all removed


def test_multinode_rollout_ranks_on_both_nodes(tmp_path):
    """Rollout rank 1 shares node 0 with the trainer (its records stay in /dev/shm); rollout ranks 2-3
    ship theirs; partial records resumed on the other node are fetched from their producer. Launched
    with our torchrun wrapper: with --master-addr 127.0.0.1 nothing of the run listens beyond loopback."""
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    procs = agents(tag, tmp_path, "run", "--steps", "6", "--rollout.ranks", "3", launcher="staleflow.launch.torchrun")
    listening = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if (run / "metrics.jsonl").is_file() and _rows(run):
            listening = _listening(tag, ours_only=False)  # our wrapper: the agents' store too
            break
        time.sleep(0.2)
    out0, out1 = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], out0[-3000:] + out1[-3000:]
    assert "node 0 [127.0.0.1]: rank 0 trainer (leader), rank 1 rollout 0" in out0
    last = [r for r in _rows(tmp_path / "run") if "eval_n" not in r][-1]
    assert last["cross_node_records"] > 0 and last["cross_node_pull_bytes"] > 0
    # Every pull interrupts the instance (partial rollout); loop-backs are routed to any instance,
    # so some resume on the other node (a dozen or more per run when measured).
    assert last["cross_node_partial_fetches"] > 0
    assert audit_run(tmp_path / "run", steps=6, batch_size=4, group_size=4, eta=1).ok
    assert listening and all(a == "0100007F" for a in listening), listening
    assert _wait_gone(tag) == []


def test_multinode_a_rollout_rank_dying_on_the_other_node_stops_the_run_naming_it(tmp_path):
    tag, shm_before = uuid.uuid4().hex, _shm()
    run = tmp_path / "run"
    procs = agents(tag, tmp_path, "run", "--steps", "200", "--rollout.ranks", "2")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").is_file() and _rows(run)):
            assert all(p.poll() is None for p in procs), "the run ended before its first step"
            time.sleep(0.2)
        victim = _titled(tag, "staleflow[rollout 0]")
        assert victim
        os.kill(victim[0], signal.SIGKILL)
        out0, out1 = finish(procs, timeout=300)
    finally:
        for p in procs:
            _kill_group(p)
    assert procs[0].returncode != 0 and procs[1].returncode != 0
    assert "rank 2 (rollout instance 0, node 1" in out0 and ("lost its connection" in out0 or "died" in out0), out0[
        -3000:
    ]
    # the emergency save lands (a StepDone that arrived while the controller looked for the cause
    # was once dropped, and the save then waited for a step that had long finished)
    assert "saved version" in out0, out0[-3000:]
    assert _wait_gone(tag) == []
    assert _leaked(shm_before) == set()


def test_multinode_c10d_rendezvous_through_our_wrapper(tmp_path):
    """c10d rendezvous, both agents on one machine: one hosts the store (bound to 127.0.0.1 by our
    wrapper), the other finds the port taken and joins it as a client, as torch's rendezvous does."""
    tag = uuid.uuid4().hex
    procs = agents(
        tag, tmp_path, "run", "--steps", "4", "--rollout.ranks", "2", launcher="staleflow.launch.torchrun", c10d=True
    )
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert any("staleflow: 4 ranks on 2 nodes (2 trainer, 2 rollout)" in out for out in outs)
    last = [r for r in _rows(tmp_path / "run") if "eval_n" not in r][-1]
    assert last["step"] == 3 and last["cross_node_records"] > 0 and last["cross_node_pull_bytes"] > 0
    assert _wait_gone(tag) == []
