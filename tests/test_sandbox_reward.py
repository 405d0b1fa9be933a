"""The code-with-tests reward (--reward.fn code_tests): the completion's last ```python block runs with
the data row's tests in the sandbox; 1.0 only for a clean pass, and every zero says why."""

from __future__ import annotations

import pytest

from staleflow.config import RewardConfig
from staleflow.reward import RewardPool, last_python_block, resolve_reward_fn, score
from staleflow.reward import code_tests as code_tests_module
from staleflow.sandbox import SandboxLimits, sandbox_unavailable

ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}


def _block(code: str, lang: str = "python") -> str:
    return f"Here is my answer.\n```{lang}\n{code}\n```\n"


@pytest.fixture
def sandbox():
    problem = sandbox_unavailable()
    if problem:
        pytest.fail(problem)


def test_sandbox_reward_last_python_block():
    text = _block("x = 1") + "```\nnot python\n```\n" + _block("x = 2", "py") + "```text\nx = 3\n```"
    assert last_python_block(text) == "x = 2\n"
    assert last_python_block("no code, only `inline`") is None


def test_sandbox_reward_scores_tests_in_the_sandbox(sandbox, monkeypatch):
    fn = resolve_reward_fn("code_tests")
    right, wrong = _block("def add(a, b):\n    return a + b"), _block("def add(a, b):\n    return a - b")
    reward, info = score(fn, _block("def add(a, b):\n    return 0") + right, "", ADD_TESTS)
    assert (reward, info["error"], info.get("reason")) == (1.0, None, None)
    reward, info = score(fn, right + wrong, "", ADD_TESTS)  # the LAST block is the answer
    assert (
        reward == 0.0
        and info["error"] is None
        and info["reason"] == "tests failed: 0 of 2 passed; test 1: AssertionError"
    )
    humaneval = {"tests": "def check(candidate):\n    assert candidate(2, 3) == 5", "entry_point": "add"}
    assert score(fn, right, "", humaneval)[0] == 1.0 and score(fn, wrong, "", humaneval)[0] == 0.0
    reward, info = score(fn, "I would write add(a, b) = a + b", "", ADD_TESTS)
    assert (reward, info["reason"], info["error"]) == (0.0, "no python code block", None)

    sneaky = _block("import os\nprint(open('/etc/passwd').read())\ndef add(a, b):\n    return a + b")
    reward, info = score(fn, sneaky, "", ADD_TESTS)
    assert (reward, info["reason"]) == (0.0, "sandbox: filesystem")
    net = _block("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\nexcept OSError:\n"
                 "    pass\ndef add(a, b):\n    return a + b")  # fmt: skip
    assert score(fn, net, "", ADD_TESTS)[1]["reason"] == "sandbox: network"  # passing tests do not excuse it
    monkeypatch.setattr(code_tests_module, "CODE_TESTS_LIMITS", SandboxLimits(wall_s=1.0, cpu_s=5))
    reward, info = score(fn, _block("import time\ntime.sleep(30)"), "", ADD_TESTS)
    assert (reward, info["reason"], info["error"]) == (0.0, "sandbox: timeout", None)


def test_sandbox_reward_bad_rows_and_missing_sandbox_are_errors(monkeypatch, tmp_path):
    fn = resolve_reward_fn("code_tests")
    right = _block("def add(a, b):\n    return a + b")
    reward, info = score(fn, right, "", {})
    assert reward == 0.0 and "needs the data row's 'tests' field" in info["error"]
    assert (
        "'entry_point' must be a Python name"
        in score(fn, right, "", {**ADD_TESTS, "entry_point": "os.system"})[1]["error"]
    )
    monkeypatch.setenv("STALEFLOW_BWRAP", str(tmp_path / "missing-bwrap"))
    reward, info = score(fn, right, "", ADD_TESTS)  # never run unsandboxed: a reward error, in one line
    assert reward == 0.0 and "bubblewrap not found" in info["error"] and "\n" not in info["error"]


def test_sandbox_reward_in_the_reward_pool(sandbox):
    right = _block("def add(a, b):\n    return a + b")
    with RewardPool(RewardConfig(fn="code_tests", workers=1, timeout_s=60.0)) as pool:
        pool.submit("right", right, "", ADD_TESTS)
        pool.submit("nothing", "no code", "", ADD_TESTS)
        got = {key: (reward, info.get("reason"), info["error"]) for key, reward, info in pool.drain(60.0)}
    assert got == {"right": (1.0, None, None), "nothing": (0.0, "no python code block", None)}


def test_sandbox_check_refuses_code_tests_without_the_sandbox(monkeypatch, tmp_path):
    from staleflow.config import ConfigError, RunConfig
    from staleflow.launch.check import check_extensions

    cfg = RunConfig(reward=RewardConfig(fn="code_tests"))
    check_extensions(cfg)  # here the sandbox starts
    monkeypatch.setenv("STALEFLOW_BWRAP", str(tmp_path / "missing-bwrap"))
    with pytest.raises(ConfigError, match=r"^--reward.fn=code_tests needs the sandbox: sandbox: bubblewrap not found"):
        check_extensions(cfg)
    check_extensions(RunConfig())  # the other rewards never need it
