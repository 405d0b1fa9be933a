"""The environment protocol (issue 40, item 1): the ENVS registry and its one-line errors, make_env,
run_step's per-step timeout, ToolEnv's steps (a malformed call becomes an observation), the
calculator's refusals, the python env over an injected run_python (and the real sandbox where it
is importable), and the --env.* config section."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from dataclasses import dataclass

import pytest

from staleflow.config import ConfigError, EnvConfig, RunConfig, config_from_dict
from staleflow.env import ENVS, Environment, EnvStep, Tool, ToolCall, env_class, format_tool_call, make_env, run_step
from staleflow.env.calculator import CalcError, CalculatorEnv, calculate
from staleflow.env.python_env import PythonEnv
from staleflow.env.tool_env import MAX_CALLS_PER_STEP, ToolEnv
from staleflow.extensions import ExtensionError


def run(coro):
    return asyncio.run(coro)


def q(expression: str) -> str:
    return format_tool_call(ToolCall("calculator", {"expression": expression}), "qwen")


# ---- registry -------------------------------------------------------------------------------------


def test_env_protocol_builtins_registered_and_built():
    assert {"calculator", "python"} <= set(ENVS)
    env = make_env(EnvConfig(name="calculator"))
    assert isinstance(env, CalculatorEnv) and isinstance(env, Environment)
    assert [s["function"]["name"] for s in env.schemas] == ["calculator"]


class GoodEnv:
    def __init__(self, cfg):
        self.cfg = cfg

    async def reset(self, prompt):
        self.prompt = prompt

    async def step(self, message):
        return EnvStep(message.upper(), done=True, reward=1.0)


class SyncEnv(GoodEnv):
    def step(self, message):  # not async: refused by make_env
        return EnvStep("", done=True)


class NoStep:
    def __init__(self, cfg):
        pass

    async def reset(self, prompt):
        pass


class Exploding(GoodEnv):
    def __init__(self, cfg):
        raise RuntimeError("no\nGPU here")


@pytest.fixture
def fork_module(monkeypatch):
    mod = types.ModuleType("fork_envs")
    mod.GoodEnv, mod.SyncEnv, mod.NoStep, mod.Exploding = GoodEnv, SyncEnv, NoStep, Exploding
    mod.a_function = lambda cfg: None
    monkeypatch.setitem(sys.modules, "fork_envs", mod)
    return mod


def test_env_protocol_import_path_loads_a_fork(fork_module):
    env = make_env(EnvConfig(name="fork_envs:GoodEnv"))
    run(env.reset(None))
    assert run(env.step("hi")) == EnvStep("HI", done=True, reward=1.0)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("nope", "is not a registered environment (calculator, python"),
        ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
        ("fork_envs:Missing", "has no attribute 'Missing'"),
        ("fork_envs:a_function", "not a class"),
        ("fork_envs:NoStep", "without a method step()"),
        ("fork_envs:SyncEnv", "not a coroutine function"),
        ("fork_envs:Exploding", "Exploding(cfg) failed (RuntimeError: no GPU here)"),
        ("fork_envs:", "an import path must look like"),
    ],
)
def test_env_protocol_bad_spec_is_one_line(fork_module, spec, words):
    with pytest.raises(ExtensionError) as e:
        make_env(EnvConfig(name=spec))
    msg = str(e.value)
    assert msg.startswith(f"--env.name={spec!r}") and words in msg and "\n" not in msg
    assert isinstance(e.value, ConfigError)  # staleflow check: exit 2


def test_env_protocol_register_env_checks_the_shape():
    with pytest.raises(TypeError, match="without a method step"):
        ENVS["broken"] = NoStep
    assert "broken" not in ENVS
    ENVS["good-test-env"] = GoodEnv
    try:
        assert env_class("good-test-env") is GoodEnv
    finally:
        del ENVS["good-test-env"]


def test_env_protocol_check_resolves_env_in_one_line(capsys):
    from staleflow.launch.check import main

    assert main(["--preset", "tiny", "--env.name", "no_such_module_xyz:Env"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--env.name='no_such_module_xyz:Env'" in err


# ---- run_step and its timeout ---------------------------------------------------------------------


class SlowEnv(GoodEnv):
    async def step(self, message):
        await asyncio.sleep(3600)


def test_env_protocol_timeout_becomes_an_observation():
    step = run(run_step(SlowEnv(None), "x", 0.05))
    assert step.error == "timeout" and not step.done and "timed out after 0.05 s" in step.observation


def test_env_protocol_timeout_of_a_tool_blocking_in_a_thread():
    """A tool stuck in its thread: the step still ends at the timeout (the thread is released after)."""
    release, finished = threading.Event(), threading.Event()

    def blocked():
        release.wait(60)
        finished.set()
        return "late"

    env = ToolEnv(EnvConfig(), tools=(Tool("wait", "", {"type": "object", "properties": {}}, fn=blocked),))

    async def go():
        try:
            step = await run_step(env, format_tool_call(ToolCall("wait", {}), "qwen"), 0.05)
            return step, finished.is_set()
        finally:
            release.set()  # before asyncio.run joins the executor's threads

    step, tool_finished = run(go())
    assert step.error == "timeout" and not step.done and not tool_finished


def test_env_protocol_run_step_passes_steps_and_checks_type():
    assert run(run_step(GoodEnv(None), "ok", 5)) == EnvStep("OK", done=True, reward=1.0)

    class Wrong(GoodEnv):
        async def step(self, message):
            return "text"

    step = run(run_step(Wrong(None), "x", 5))  # the model reads it; the rank goes on (issue 50)
    assert not step.done and step.error == "environment: Wrong step returned str, not an EnvStep"


# ---- ToolEnv steps --------------------------------------------------------------------------------


def test_env_protocol_calculator_episode():
    env = make_env(EnvConfig(name="calculator"))
    run(env.reset(None))
    step = run(env.step("Let me check.\n" + q("12 * 7") + "<|im_end|>"))
    assert (step.observation, step.done, step.tool_calls, step.error, step.reward) == ("84", False, 1, None, None)
    assert step.tool_s >= 0
    done = run(env.step("12 * 7 = 84, so the answer is 84."))
    assert done.done and done.observation == "" and done.tool_calls == 0 and done.reward is None


@pytest.mark.parametrize(
    "message, words",
    [
        ("<tool_call>\n{not json}\n</tool_call>", "not valid JSON"),
        (
            format_tool_call(ToolCall("calc", {"expression": "1"}), "qwen"),
            "unknown tool 'calc'; the tools are calculator",
        ),
        (format_tool_call(ToolCall("calculator", {"expr": "1"}), "qwen"), "needs the argument(s) expression"),
        (q("2 ** 99999"), "the exponent is too large"),
        ('<tool_call>\n{"name": "calculator"', "not closed"),
    ],
)
def test_env_protocol_malformed_call_becomes_the_observation(message, words):
    step = run(CalculatorEnv(EnvConfig()).step(message))
    assert not step.done and step.observation.startswith("Error: ") and words in step.observation
    assert step.error and words in step.error and step.tool_calls == 1


def test_env_protocol_several_calls_and_the_call_cap():
    step = run(CalculatorEnv(EnvConfig()).step(q("1+1") + q("x") + q("3*3")))
    assert step.tool_calls == 3 and step.observation.startswith("[1] calculator: 2\n\n[2] calculator: Error: a name")
    assert step.observation.endswith("[3] calculator: 9") and "a name is not allowed" in step.error
    many = run(CalculatorEnv(EnvConfig()).step("".join(q(str(i)) for i in range(MAX_CALLS_PER_STEP + 2))))
    assert many.tool_calls == MAX_CALLS_PER_STEP + 2 and "2 dropped" in many.observation


def test_env_protocol_tool_format_is_honoured():
    llama = format_tool_call(ToolCall("calculator", {"expression": "6*7"}), "llama3")
    assert run(CalculatorEnv(EnvConfig(tool_format="auto")).step(llama)).observation == "42"
    assert run(CalculatorEnv(EnvConfig(tool_format="llama3")).step(llama)).observation == "42"
    assert run(CalculatorEnv(EnvConfig(tool_format="qwen")).step(llama)).done  # not qwen syntax: an answer


# ---- the calculator -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [
        ("(2 + 3) * 4 ** 2 // 3", 26),
        ("10 / 4", 2.5),
        ("-7 % 3", 2),
        ("2 ** -2", 0.25),
        ("2 ** 64", 2**64),
        ("+1.5e3", 1500.0),
    ],
)
def test_env_protocol_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, words",
    [
        ("9 ** 9 ** 9", "exponent is too large"),
        ("2 ** 5000", "exponent is too large"),
        ("(10 ** 1000) * (10 ** 1000)", "too large"),
        ("1.5 ** 1e9", "exponent is too large"),
        ("10.0 ** 400", "too large"),
        ("__import__('os').system('true')", "a function call is not allowed"),
        ("x + 1", "a name is not allowed"),
        ("(1).real", "an attribute is not allowed"),
        ("'ab' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("[1][0]", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("1 < 2", "not allowed"),
        ("2 ^ 3", "write **"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than 256"),
        ("+".join(["1"] * 40), "more than 64 parts"),
        ("", "give an arithmetic expression"),
    ],
)
def test_env_protocol_calculator_refuses(expression, words):
    with pytest.raises(CalcError) as e:
        calculate(expression)
    assert words in str(e.value)


# ---- the python env -------------------------------------------------------------------------------


@dataclass
class FakeResult:
    stdout: str
    stderr: str = ""
    exit_code: int | None = 0
    reason: str | None = None
    wall_s: float = 0.01


def test_env_protocol_python_env_over_an_injected_run_python():
    seen = []

    def fake(code, limits, stdin=""):
        seen.append((code, limits))
        if "loop" in code:
            return FakeResult("partial\n", "", None, "timeout")
        if "boom" in code:
            return FakeResult("", "Traceback ...\nZeroDivisionError", 1)
        return FakeResult("5\n")

    env = PythonEnv(EnvConfig(name="python"), run_python=fake, limits="LIMITS")
    call = format_tool_call(ToolCall("python", {"code": "print(2 + 3)"}), "qwen")
    assert run(env.step(call)).observation == "5" and seen == [("print(2 + 3)", "LIMITS")]
    stopped = run(env.step(format_tool_call(ToolCall("python", {"code": "loop"}), "qwen"))).observation
    assert stopped == "partial\n[stopped by the sandbox: timeout]"
    failed = run(env.step(format_tool_call(ToolCall("python", {"code": "boom"}), "qwen"))).observation
    assert "stderr:\nTraceback" in failed and failed.endswith("[exit code 1]")
    tagged = run(env.step("<|python_tag|>print(2 + 3)<|eom_id|>"))  # Llama 3.1's code form
    assert tagged.observation == "5" and seen[-1][0] == "print(2 + 3)"
    assert run(env.step("It is 5.")).done


def test_env_protocol_python_env_without_sandbox_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "staleflow.sandbox", None)  # import fails as if not installed
    with pytest.raises(ExtensionError) as e:
        make_env(EnvConfig(name="python"))
    assert "needs staleflow.sandbox" in str(e.value) and "\n" not in str(e.value)


def test_env_protocol_python_env_in_the_real_sandbox():
    sandbox = pytest.importorskip("staleflow.sandbox")
    why = sandbox.sandbox_unavailable()
    if why:
        pytest.skip(why)
    env = make_env(EnvConfig(name="python"))
    step = run(env.step(format_tool_call(ToolCall("python", {"code": "print(6 * 7)"}), "qwen")))
    assert step.observation == "42" and step.error is None


# ---- config ---------------------------------------------------------------------------------------


def test_env_protocol_config_flags_and_checks():
    from staleflow.config.parse import parse
    from staleflow.presets import PRESETS

    assert RunConfig().env.name == ""  # single-turn by default: today's behaviour
    argv = ["--preset", "tiny", "--env.name", "calculator", "--env.max-turns", "3", "--env.tool-format", "llama3"]
    argv += ["--env.step-timeout-s", "2.5", "--env.max-observation-tokens", "64"]
    cfg = parse(RunConfig, argv, PRESETS, default="tiny", prog="staleflow train")
    assert (cfg.env.name, cfg.env.max_turns, cfg.env.tool_format, cfg.env.step_timeout_s) == (
        "calculator",
        3,
        "llama3",
        2.5,
    )
    import dataclasses
    import json

    assert config_from_dict(RunConfig, json.loads(json.dumps(dataclasses.asdict(cfg)))).env == cfg.env


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"max_turns": 0}, "--env.max-turns=0"),
        ({"max_total_tokens": -1}, "--env.max-total-tokens=-1"),
        ({"max_turn_tokens": -1}, "--env.max-turn-tokens=-1"),
        ({"max_observation_tokens": 8}, "--env.max-observation-tokens=8"),
        ({"step_timeout_s": 0.0}, "--env.step-timeout-s=0.0"),
        ({"tool_format": "hermes"}, "--env.tool-format='hermes'"),
    ],
)
def test_env_protocol_config_range_checks(kwargs, flag):
    with pytest.raises(ConfigError) as e:
        EnvConfig(**kwargs)
    assert str(e.value).startswith(flag) and "\n" not in str(e.value)


def test_env_protocol_config_total_tokens_fit_the_model_length():
    from staleflow.config import RolloutConfig

    with pytest.raises(ConfigError, match="--env.max-total-tokens=4096 is invalid: must be < --rollout.max-model-len"):
        RunConfig(env=EnvConfig(name="calculator", max_total_tokens=4096), rollout=RolloutConfig(max_model_len=2048))
    RunConfig(env=EnvConfig(name="", max_total_tokens=4096), rollout=RolloutConfig(max_model_len=2048))  # unused
    RunConfig(env=EnvConfig(name="calculator"), rollout=RolloutConfig(max_model_len=256))  # 0: the model length


def test_env_protocol_config_every_flag_has_help():
    import tyro._docstrings as docs

    missing = [
        f for f in EnvConfig.__dataclass_fields__ if not (docs.get_field_docstring(EnvConfig, f, ()) or "").strip()
    ]
    assert missing == []


# ---- docs/multi-turn.md's worked examples -----------------------------------------------------------


def _doc_example(marker: str) -> dict:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "multi-turn.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if marker in b]
    namespace: dict = {}
    exec(compile(block, f"docs/multi-turn.md ({marker})", "exec"), namespace)  # our own doc's code
    return namespace


def test_env_protocol_doc_examples_run():
    from staleflow.trajectory import Prompt

    units = _doc_example("class UnitsEnv")
    try:
        env = make_env(EnvConfig(name="units"))
        call = format_tool_call(ToolCall("convert", {"value": 5, "source": "km", "target": "m"}), "qwen")
        assert run(env.step(call)).observation == "5000 m"
        back = format_tool_call(ToolCall("convert", {"value": 250, "source": "cm", "target": "m"}), "llama3")
        assert run(env.step(back)).observation == "2.5 m"
        bad = run(env.step(format_tool_call(ToolCall("convert", {"value": 1, "source": "kg", "target": "m"}), "qwen")))
        assert bad.observation == "Error: cannot convert kg to m" and bad.error == "cannot convert kg to m"
        assert run(env.step("5 km is 5000 m.")).done
    finally:
        del ENVS["units"]
    assert units["UnitsEnv"].tools[0].name == "convert"

    tries = _doc_example("class TwoTries")["TwoTries"](EnvConfig())
    run(tries.reset(Prompt(1, "What is 2 + 3?", "5", [1])))
    first = run(tries.step("It is 6."))
    assert not first.done and "again" in first.observation
    assert run(tries.step("Sorry: 7.")) == EnvStep("", done=True, reward=0.0)
    run(tries.reset(Prompt(1, "What is 2 + 3?", "5", [1])))
    assert run(tries.step("It is 5.")).reward == 1.0


def test_env_protocol_python_env_sandbox_stops_before_the_step_timeout(monkeypatch):
    import staleflow.env.python_env as python_env

    @dataclass(frozen=True)
    class Limits:
        wall_s: float = 10.0
        memory_mb: int = 512

    seen = []
    fake = lambda code, limits, stdin="": seen.append(limits) or FakeResult("ok")  # noqa: E731
    monkeypatch.setattr(python_env, "sandbox_runner", lambda: (fake, Limits()))
    env = make_env(EnvConfig(name="python", step_timeout_s=4.0))
    assert run(env.step(format_tool_call(ToolCall("python", {"code": "print(1)"}), "qwen"))).observation == "ok"
    assert seen == [Limits(wall_s=0.9 * 4.0)]
    make_env(EnvConfig(name="python", step_timeout_s=60.0)).run("x")
    assert seen[-1] == Limits()  # the sandbox's own limit when it is the shorter one
