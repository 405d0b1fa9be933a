"""The code-with-tests reward: the completion's last ```python block runs with the row's tests in the
sandbox (staleflow.sandbox); 1.0 when the program exits 0 untouched by any limit, else 0.0.

    --reward.fn code_tests
    row: {"prompt": "Write add(a, b) ...", "answer": "<reference solution, unused>",
          "tests": "assert add(1, 2) == 3"}                       # or a list of asserts (MBPP's test_list)
    row: {..., "tests": "def check(candidate): ...", "entry_point": "add"}   # HumanEval's form

The program is the block, a blank line, the tests (a list joined by newlines) and, with
``entry_point``, ``check(<entry_point>)``. A zero always carries its reason (NoCredit, recorded by
``score`` in info["reason"]): no python block, tests failed (exit code), or the sandbox's reason
(timeout, memory, network, ...). A sandbox that cannot start raises (a reward error, never a run of
the code outside it).
"""

from __future__ import annotations

import re

from staleflow.reward.functions import NoCredit, register_reward
from staleflow.sandbox import SandboxLimits, run_python, sandbox_unavailable

CODE_TESTS_LIMITS = SandboxLimits(wall_s=15.0, cpu_s=5, memory_mb=512, processes=16, output_bytes=16_000)
"""The sandbox's limits for one solution + its tests (docs/sandbox.md)."""
_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def last_python_block(completion: str) -> str | None:
    """The code of the last ```python (or ```py) fenced block, None if there is none."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def tests_program(code: str, meta: dict) -> str:
    """The program the sandbox runs: the solution, then the row's tests (and check(entry_point))."""
    if "tests" not in meta:
        raise ValueError("code_tests reward needs the data row's 'tests' field (Python asserts, a string or a list)")
    tests = meta["tests"]
    if not isinstance(tests, str) and hasattr(tests, "__iter__"):  # a list (JSONL) or an array (parquet)
        tests = list(tests)
        tests = "\n".join(tests) if all(isinstance(t, str) for t in tests) else tests
    if not isinstance(tests, str) or not tests.strip():
        raise ValueError(
            f"code_tests reward: the row's 'tests' must be non-empty Python text or a list of it, got {tests!r}"
        )
    program = f"{code}\n\n{tests}\n"
    entry = meta.get("entry_point")
    if entry:
        if not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError(f"code_tests reward: 'entry_point' must be a Python name, got {entry!r}")
        program += f"\ncheck({entry})\n"
    return program


@register_reward("code_tests")
def code_tests_reward(completion: str, answer: str, meta: dict) -> float:
    """1.0 if the last ```python block passes the row's tests in the sandbox; else NoCredit(reason)."""
    code = last_python_block(completion)
    program = tests_program(code or "", meta)
    if code is None:
        raise NoCredit("no python code block")
    result = run_python(program, CODE_TESTS_LIMITS)
    if result.reason == "unavailable":
        raise RuntimeError(sandbox_unavailable() or result.stderr)
    if result.reason is not None:
        raise NoCredit(f"sandbox: {result.reason}")
    if result.exit_code != 0:
        last = (result.stderr.strip().splitlines() or [""])[-1][:200]
        raise NoCredit(f"tests failed (exit {result.exit_code}): {last}")
    return 1.0
