"""torchrun's rendezvous state is never unpickled freely (launch/rendezvous_guard.py), and every rank
dies with its agent (launch/lifeline.py).

The attacker's view: a local process reads the agent's command line in /proc (rendezvous port and
id), connects to the unauthenticated store and sets ``torch.rendezvous.<id>`` to a pickle that
would create a canary file. Under torch's own torchrun that runs (the control case below, on the
same torch code path); under ``staleflow.launch.torchrun`` it must never run.
"""

from __future__ import annotations

import base64
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from staleflow.launch import rendezvous_guard as guard

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


class _Payload:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


class _Backend:
    """A rendezvous backend whose store someone else wrote (the attacker)."""

    name = "fake"

    def __init__(self, data: bytes):
        self.data = data

    def get_state(self):
        return self.data, 1

    def set_state(self, state, token=None):
        return self.data, 1, False


def _settings():
    return dynamic.RendezvousSettings("rid", 1, 1, dynamic.RendezvousTimeout(), timedelta(seconds=5), 3)


def _real_state(now: datetime | None = None) -> dynamic._RendezvousState:
    state = dynamic._RendezvousState()
    a, b = dynamic._NodeDesc("127.0.0.1", 4242, 0), dynamic._NodeDesc("10.0.0.2", 17, 3)
    state.round, state.complete = 3, True
    now = now or datetime(2026, 12, 3, 8, 30, 0, 123456, tzinfo=UTC)  # fixed: the fuzz test mutates bytes
    state.deadline = now + timedelta(seconds=30)
    state.participants = {a: 0, b: 1}
    state.wait_list = {b}
    state.redundancy_list = set()
    state.last_heartbeats = {a: now, b: now - timedelta(seconds=1)}
    return state


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setattr(dynamic, "pickle", pickle)  # undone after the test
    return guard.install("key torch.rendezvous.rid")


def test_rendezvous_payload_runs_under_torchs_own_sync_but_not_guarded(tmp_path, monkeypatch, guarded):
    canary = tmp_path / "canary"
    data = pickle.dumps(_Payload(canary))
    monkeypatch.setattr(dynamic, "pickle", pickle)  # torch as shipped: the attack is real
    with pytest.raises(AttributeError):  # the payload ran, then torch chokes on its result (an int)
        dynamic._BackendRendezvousStateHolder(_Backend(data), _settings(), cache_duration=0).sync()
    assert canary.exists()
    canary.unlink()
    monkeypatch.setattr(dynamic, "pickle", guarded)
    holder = dynamic._BackendRendezvousStateHolder(_Backend(data), _settings(), cache_duration=0)
    with pytest.raises(RendezvousStateError) as info:
        holder.sync()
    assert isinstance(info.value.__cause__, guard.UnsafeRendezvousState)
    assert "posix.system" in str(info.value.__cause__) and not canary.exists()


def test_rendezvous_guard_decodes_torchs_real_state(guarded):
    state = _real_state(datetime.now(UTC))  # live heartbeats: torch's sync keeps the nodes
    holder = dynamic._BackendRendezvousStateHolder(_Backend(pickle.dumps(state)), _settings(), cache_duration=0)
    holder.sync()
    assert holder.state.participants == state.participants and holder.state.round == 3
    assert holder.state.wait_list == state.wait_list and holder.state.deadline == state.deadline


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: setattr(s, "round", "3"),
        lambda s: setattr(s, "round", 1 << 70),
        lambda s: setattr(s, "participants", [1, 2]),
        lambda s: s.participants.update({dynamic._NodeDesc("h", -1, 0): 0}),
        lambda s: s.participants.update({dynamic._NodeDesc("h", 1, 0): 1.5}),
        lambda s: setattr(s, "deadline", datetime(2030, 1, 1)),  # naive: torch would fail comparing it
        lambda s: setattr(s, "extra", 1),
        lambda s: s.wait_list.add(("h", 1, 0)),
    ],
)
def test_rendezvous_guard_refuses_a_state_of_the_wrong_shape(mutate):
    state = _real_state()
    mutate(state)
    with pytest.raises(guard.UnsafeRendezvousState):
        guard.safe_loads(pickle.dumps(state), dynamic)


def test_rendezvous_guard_refuses_a_torch_that_unpickles_elsewhere(monkeypatch):
    monkeypatch.setattr(dynamic, "pickle", pickle)
    monkeypatch.setattr(dynamic, "loads", pickle.loads, raising=False)
    with pytest.raises(guard.GuardError):
        guard.install()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_reader_rendezvous_state(data):
    """Random bytes and bit-flipped real states: a valid state or UnsafeRendezvousState, nothing else."""
    base = bytearray(pickle.dumps(_real_state(), protocol=data.draw(st.integers(2, 5))))
    kind = data.draw(st.sampled_from(["flip", "cut", "random"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            base[data.draw(st.integers(0, len(base) - 1))] = data.draw(st.integers(0, 255))
        blob = bytes(base)
    elif kind == "cut":
        blob = bytes(base[: data.draw(st.integers(0, len(base)))])
    else:
        blob = data.draw(st.binary(max_size=512))
    try:
        state = guard.safe_loads(blob, dynamic)
    except guard.UnsafeRendezvousState:
        return
    guard.check_state(state, dynamic)


# ---- a real agent ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_agent(tmp_path: Path, module: str, rdzv_id: str):
    port = _free_port()
    cmd = [sys.executable, "-m", module, "--nnodes", "1", "--nproc_per_node", "1", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1", "--rdzv-id", rdzv_id]
    cmd += ["--max-restarts", "0", str(HERE / "agent_job.py"), str(tmp_path / "worker.pid"), "120"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    agent = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "worker.pid").exists():
        if agent.poll() is not None or time.monotonic() > deadline:
            agent.kill()
            pytest.fail(f"the worker never started: {agent.communicate()[0][-2000:]}")
        time.sleep(0.1)
    return agent, int((tmp_path / "worker.pid").read_text())


def _attacker_reads(agent_pid: int) -> tuple[int, str]:
    """Port and run id from the agent's command line, as any local user can read them."""
    argv = Path(f"/proc/{agent_pid}/cmdline").read_bytes().decode().split("\0")
    endpoint = argv[argv.index("--rdzv-endpoint") + 1]
    return int(endpoint.rsplit(":", 1)[1]), argv[argv.index("--rdzv-id") + 1]


def _gone_within(pid: int, seconds: float) -> bool:
    from staleflow.runfolder.scratch import pid_alive

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def _kill(proc, pid: int) -> None:
    for p in (proc.pid, pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def test_rendezvous_attacker_payload_never_runs_in_the_agent(tmp_path):
    import torch.distributed as dist

    agent, worker = _start_agent(tmp_path, "staleflow.launch.torchrun", "rdzvprobe")
    canary = tmp_path / "canary"
    try:
        port, rdzv_id = _attacker_reads(agent.pid)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        store.set(f"torch.rendezvous.{rdzv_id}", base64.b64encode(pickle.dumps(_Payload(canary))))
        out, _ = agent.communicate(timeout=60)  # the agent re-reads its state every second or so
    finally:
        if agent.poll() is None:
            _kill(agent, worker)
    assert not canary.exists()
    assert agent.returncode != 0
    refusals = [line for line in out.splitlines() if line.startswith("staleflow: refused the rendezvous state")]
    assert len(refusals) == 1 and f"torch.rendezvous.{rdzv_id}" in refusals[0], out[-2000:]
    assert "Traceback" not in out, out[-3000:]
    assert _gone_within(worker, 30), "the worker outlived its agent"


def test_agent_death_takes_its_worker_with_it(tmp_path):
    agent, worker = _start_agent(tmp_path, "staleflow.launch.torchrun", "deathprobe")
    try:
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
        assert _gone_within(worker, 30), "the worker outlived its agent"
    finally:
        _kill(agent, worker)
