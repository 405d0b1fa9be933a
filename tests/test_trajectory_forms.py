"""A trajectory meets only the four forms of staleflow/trajectory.py, and they travel as they are.

The end-to-end test runs the tiny preset through launch.sh with a sitecustomize (every process of
the run imports it) that records the type of every struct the control plane encodes, nested ones
included: a relay that renamed a form (RouteTraj, TrajDone, TrainItem) would show up by name."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from staleflow import trajectory
from staleflow.control.messages import TrainStep, decode, encode
from staleflow.trajectory import FORMS, Finished, RecordHandle, Route, TrainGroup

ROOT = Path(__file__).resolve().parents[1]
WIRE_FORMS = {"Route", "Finished", "TrainGroup", "RecordHandle"}
"""The forms (and the handle naming a generated trajectory's bytes) that cross processes."""
PARTS = {"TurnStats"}
"""Carried inside a form (a multi-turn Finished's figures): seen only in runs with an environment."""
NOT_TRAJECTORIES = {
    "InstanceSnapshot",
    "Interrupt",
    "Abort",
    "Pull",
    "Pulled",
    "FreeRecords",
    "TrainStep",
    "StepDone",
    "SaveState",
    "Saved",
    "Evaluate",
    "Evaluated",
    "Register",
    "Ready",
    "Welcome",
    "Heartbeat",
    "Failure",
    "Shutdown",
    "Goodbye",
    "Ping",
    "Pong",
}
"""Commands, snapshots and control messages: they name trajectories by id or handle, never copy one."""

_HOOK = textwrap.dedent("""
    import os
    import msgspec
    from staleflow.control import messages as _m

    _encode = _m.encode

    def _walk(x, out):
        if isinstance(x, msgspec.Struct):
            out.add(type(x).__name__)
            for f in x.__struct_fields__:
                _walk(getattr(x, f), out)
        elif isinstance(x, (list, tuple)):
            for y in x[:8]:
                _walk(y, out)

    def encode(msg):
        seen = set()
        _walk(msg, seen)
        with open(os.environ["STALEFLOW_WIRE_LOG"], "a") as f:
            f.write(" ".join(sorted(seen)) + "\\n")
        return _encode(msg)

    _m.encode = encode
""")


def test_trajectory_forms_are_four_plain_classes_in_path_order():
    assert [c.__name__ for c in FORMS] == ["Prompt", "Route", "Finished", "TrainGroup"]
    assert all(c.__module__ == "staleflow.trajectory" for c in FORMS)
    assert "torch" not in trajectory.__dict__  # the pure core imports these


def test_trajectory_forms_one_token_payload_from_engine_to_sample():
    """Response tokens, behaviour log-probs, per-token versions and the loss mask are declared once
    (TrajectoryTokens); the engine's Request (its input and its output) and the ring hold that class,
    the trainer takes it beside its TrainGroup, and no other module declares those fields or the old
    names. No engine class holds a payload of its own: the built-in engine's Sequence references its
    Request (KV and scheduling state besides), the vLLM engine keeps Requests and side tables by id."""
    import dataclasses
    import re

    from staleflow.rollout import engine as rollout_engine
    from staleflow.rollout import vllm_support
    from staleflow.rollout.engine import Request
    from staleflow.rollout.sequence import Sequence
    from staleflow.servers.trajectory import TrajectoryRing

    payload = {"prompt_ids", "response_ids", "behaviour_logprobs", "versions", "loss_mask"}
    assert {f.name for f in dataclasses.fields(trajectory.TrajectoryTokens)} == payload
    from staleflow.train.batch import build_micro_batch, step_payloads

    fields = {f.name: f.type for f in dataclasses.fields(Request)}
    assert "TrajectoryTokens" in str(fields["tokens"]) and not payload & set(fields)
    # the engine returns the finished Request: no output class, no engine-side payload holder
    assert not hasattr(rollout_engine, "RequestOutput") and not hasattr(vllm_support, "_Live")
    # the speculative draft rides on the sequence (engine scheduling state), never the payload
    assert Sequence.__slots__ == ("request", "num_computed", "block_table", "status", "arrival", "kv_epoch", "draft")
    for path in (ROOT / "src" / "staleflow" / "rollout").glob("*.py"):  # only Request sets a payload
        if path.name != "engine.py":
            assert not re.search(r"\bself\.tokens\s*(:[^=\n]*)?=", path.read_text()), f"{path} holds a payload"
    # the trainer takes the TrainGroups and their payloads: no per-trajectory class repeats reward and V_traj
    assert not hasattr(trajectory, "TrajectorySample")
    assert "TrainGroup" in step_payloads.__annotations__["groups"]
    assert "TrajectoryTokens" in step_payloads.__annotations__["payloads"]
    assert "TrajectoryTokens" in build_micro_batch.__annotations__["payloads"]
    assert "TrajectoryTokens" in str(TrajectoryRing.read.__annotations__["return"])
    declared = re.compile(
        r"^\s+(response_ids|behaviour_logprobs|loss_mask|output_ids|output_logprobs|output_versions)\s*[:=]"
    )
    for path in (ROOT / "src" / "staleflow").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"\boutput_(ids|logprobs|versions)\b", text), f"{path}: an old name of a payload field"
        if path.name != "tokens.py" or path.parent.name != "staleflow":
            hits = [ln for ln in text.splitlines() if declared.match(ln)]
            assert not hits, f"{path} declares payload fields outside TrajectoryTokens: {hits[:2]}"


def test_trajectory_forms_one_copy_of_the_turn_figures():
    """A multi-turn trajectory's turns, tool calls and tool seconds are declared once, in TurnStats: its Finished
    carries one, the ledger's Traj holds one, the rank's Episode counts in one (they were copied field by field
    into Finished and Traj before issue 48)."""
    import ast
    import typing

    from staleflow.controller.ledger import Traj
    from staleflow.workers.turns import Episode

    figures = {"turns", "tool_calls", "tool_s"}
    owners = []
    for path in (ROOT / "src" / "staleflow").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {
                    b.target.id for b in node.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)
                }
                if figures <= names:
                    owners.append(node.name)
    assert owners == ["TurnStats"]
    hints = {c: typing.get_type_hints(c) for c in (Finished, Traj, Episode)}
    assert all("TurnStats" in str(h) for h in (hints[Finished]["stats"], hints[Traj]["turns"], hints[Episode]["stats"]))
    fin = Finished(1, 0, None, 3, stats=trajectory.TurnStats(2, 1, 0.5, env_reward=1.0))
    assert decode(encode(fin)) == fin


def test_trajectory_forms_round_trip_on_the_wire_as_themselves():
    h = RecordHandle(1, 128, 512, 7)
    route = Route(12, 1, 4, prompt_ids=[1, 2, 3], prompt_len=3, seed=99, partial=h, max_new_tokens=16)
    fin = Finished(12, 1, h, 96, partial=True, finish_reason="abort", cross_node_copies=1)
    step = TrainStep(version=4, groups=[TrainGroup(3, 4, [12, 13], [h, h], [1.0, 0.0], [96, 80], 3)])
    for msg in (route, fin, step):
        back = decode(encode(msg))
        assert back == msg and type(back) is type(msg)
    assert isinstance(decode(encode(step)).groups[0].handles[0], RecordHandle)
    assert not hasattr(trajectory, "TrajectoryItem")  # the Trajectory Server queues ids (the ledger's Traj)


@pytest.mark.slow
def test_trajectory_forms_one_run_puts_only_the_forms_on_the_wire(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOOK)
    log = tmp_path / "wire.log"
    env = dict(
        os.environ,
        STALEFLOW_WIRE_LOG=str(log),
        STALEFLOW_MAX_RESTARTS="0",
        PYTHONPATH=os.pathsep.join(p for p in (str(hook), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p),
    )
    res = subprocess.run(
        [
            "bash",
            str(ROOT / "launch.sh"),
            "--preset",
            "tiny",
            "--steps",
            "2",
            "--log.no-progress",
            "--log.no-plot",
            "--log.run-dir",
            str(tmp_path / "runs"),
            "--log.name",
            "forms",
            "--checkpoint.no-export-hf",
            "--reward.fn",
            "e2e_rewards:text_length",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    seen = set(" ".join(log.read_text().splitlines()).split())
    assert WIRE_FORMS <= seen, f"the run never sent {sorted(WIRE_FORMS - seen)}"
    assert seen <= WIRE_FORMS | PARTS | NOT_TRAJECTORIES, (
        f"unexpected on the wire: {sorted(seen - WIRE_FORMS - PARTS - NOT_TRAJECTORIES)}"
    )
