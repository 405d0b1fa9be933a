"""End-to-end multi-turn run: the real system (torchrun, 1 trainer + 2 rollout ranks + controller),
the tiny preset and a test environment whose tool sleeps (tests/e2e_envs.py:SleepyEnv, 3 turns).

Checks: every trained trajectory within eta (the run's audit trail), none trained twice; each one
holds model and environment tokens (fewer model tokens than response tokens, the model's with
versions); metrics.jsonl carries turns, tool calls and tool seconds per trajectory; report.png is
written with them; held-out answers talk to the environment too (3 turns each).
"""

import os
import subprocess
import uuid

import pytest
from test_e2e import _check_audit, _env, _rows
from test_launch import TORCHRUN, _kill_group

pytestmark = pytest.mark.slow


def test_multi_turn_tiny_run_end_to_end(tmp_path):
    eta = 1
    cmd = [
        *TORCHRUN,
        "-m",
        "staleflow",
        "train",
        "--preset",
        "tiny",
        "--log.run-dir",
        str(tmp_path),
        "--log.name",
        "mt",
        "--reward.fn",
        "e2e_rewards:text_length",
        "--env.name",
        "e2e_envs:SleepyEnv",
        "--steps",
        "2",
        "--staleness.eta",
        str(eta),
        "--eval.n",
        "4",
        "--eval.every",
        "2",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(uuid.uuid4().hex),
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, out
    run = os.path.join(tmp_path, "mt")
    rows = _rows(os.path.join(run, "metrics.jsonl"))
    steps = [r for r in rows if "eval_n" not in r]
    assert len(steps) == 2
    evals = [r for r in rows if "eval_n" in r]
    assert [e["step"] for e in evals] == [0, 2] and all(e["eval_turns_mean"] == 3.0 for e in evals)  # env too
    for s in steps:
        assert s["turns_mean"] == 3.0 and s["tool_calls_per_traj"] == 2.0, s  # SleepyEnv: 3 turns, 2 tool calls
        assert s["tool_s_per_traj"] >= 0.099 and s["bound_violations"] == 0
    for row in _check_audit(run, eta):
        for n, versions in zip(row["n_tokens"], row["token_versions"]):
            model = sum(count for _, count in versions)
            assert 0 < model < n, row  # observations are response tokens outside the loss
    assert os.path.getsize(os.path.join(run, "report.png")) > 0
