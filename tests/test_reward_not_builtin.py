"""A reward function is the user's own Python function: builtins and standard-library functions
(which would run each completion as code or as a command) are refused in one line."""

from __future__ import annotations

import functools
import os

import pytest

from staleflow.reward.functions import RewardError, resolve_reward_fn


@pytest.mark.parametrize("spec", ["builtins:exec", "builtins:eval", "builtins:compile", "os:popen", "subprocess:run"])
def test_remote_code_builtin_or_stdlib_reward_function_is_refused(spec, tmp_path):
    with pytest.raises(RewardError) as info:
        resolve_reward_fn(spec)
    msg = str(info.value)
    assert "\n" not in msg and spec in msg and "plain Python function" in msg or "cannot be called" in msg, msg


def test_remote_code_os_system_is_refused():
    with pytest.raises(RewardError, match="os:system"):
        resolve_reward_fn("os:system")


def test_user_functions_and_builtin_names_still_resolve(monkeypatch, tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "import functools\n"
        "def exact(completion, answer, meta):\n    return float(completion.strip() == answer)\n"
        "partial = functools.partial(exact)\n"
        "shell = functools.partial(__import__('os').system)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward_fn("my_rewards:exact")("5", "5", {}) == 1.0
    assert resolve_reward_fn("my_rewards:partial")("4", "5", {}) == 0.0
    with pytest.raises(RewardError):
        resolve_reward_fn("my_rewards:shell")  # a partial of a builtin is judged by what it calls
    for name in ("math", "arithmetic", "countdown"):
        assert callable(resolve_reward_fn(name))
    assert functools and os
