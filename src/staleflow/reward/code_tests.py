"""The code-with-tests reward: the completion's last ```python block is tested by the row's tests in the
sandbox (staleflow.sandbox.tests_run); 1.0 when every test passes untouched by any limit, else 0.0.

    --reward.fn code_tests
    row: {"prompt": "Write add(a, b) ...", "answer": "<reference solution, unused>",
          "tests": "assert add(1, 2) == 3"}                       # or a list of asserts (MBPP's test_list)
    row: {..., "tests": "def check(candidate): ...", "entry_point": "add"}   # HumanEval's form

Each top-level statement of the tests (a list: of each string), then ``check(<entry_point>)`` with
``entry_point``, is one test. The solution runs in one process and the tests in another, the
harness, which calls the solution's functions through a pipe with plain data and alone reports a
result per test, with a per-run nonce, on a pipe the solution never holds: exiting early, patching
builtins or assert, printing a marker, signals, atexit or __del__ earn nothing (docs/sandbox.md,
"The code-with-tests reward"). A zero always carries its reason (NoCredit, recorded by ``score`` in
info["reason"]): no python block, tests failed (k of N passed, the first failure), a forged verdict
line, or the sandbox's reason (timeout, memory, network, ...). A sandbox that cannot start raises (a
reward error, never a run of the code outside it), so does a row whose tests do not parse.
"""

from __future__ import annotations

import re

from staleflow.reward.functions import NoCredit, register_reward
from staleflow.sandbox import SandboxLimits, SandboxResult, sandbox_unavailable
from staleflow.sandbox.tests_run import run_tests, split_tests

CODE_TESTS_LIMITS = SandboxLimits(wall_s=15.0, cpu_s=5, memory_mb=512, processes=16, output_bytes=16_000)
"""The sandbox's limits for one solution + its tests (docs/sandbox.md)."""
_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def last_python_block(completion: str) -> str | None:
    """The code of the last ```python (or ```py) fenced block, None if there is none."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def row_tests(meta: dict) -> list[str]:
    """The row's tests as test statements (sandbox/tests_run.split_tests), ``check(<entry_point>)``
    last when the row has an entry point; ValueError (a reward error: the row's fault) otherwise."""
    if "tests" not in meta:
        raise ValueError("code_tests reward needs the data row's 'tests' field (Python asserts, a string or a list)")
    tests = meta["tests"]
    if not isinstance(tests, str) and hasattr(tests, "__iter__"):  # a list (JSONL) or an array (parquet)
        tests = list(tests)
    parts = [tests] if isinstance(tests, str) else tests
    if not parts or not all(isinstance(t, str) for t in parts) or not any(t.strip() for t in parts):
        raise ValueError(
            f"code_tests reward: the row's 'tests' must be non-empty Python text or a list of it, got {tests!r}"[:300]
        )
    entry = meta.get("entry_point")
    if entry:
        if not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError(f"code_tests reward: 'entry_point' must be a Python name, got {entry!r}")
        parts = [*parts, f"check({entry})"]
    return split_tests(parts)


@register_reward("code_tests")
def code_tests_reward(completion: str, answer: str, meta: dict) -> float:
    """1.0 if every test of the row passes against the last ```python block (sandbox/tests_run.py:
    the tests run in a harness the solution cannot reach); else NoCredit(reason)."""
    code = last_python_block(completion)
    tests = row_tests(meta)
    if code is None:
        raise NoCredit("no python code block")
    result = run_tests(code, tests, CODE_TESTS_LIMITS)
    if isinstance(result, SandboxResult):  # reason "unavailable": nothing ran
        raise RuntimeError(sandbox_unavailable() or result.stderr)
    if result.error:
        raise RuntimeError(result.error)
    if result.forged:
        raise NoCredit("a verdict line without this run's nonce: forged by the solution")
    if result.reason is not None:
        raise NoCredit(f"sandbox: {result.reason}")
    if not result.ok:
        raise NoCredit(f"tests failed: {result.passed} of {result.total} passed; {result.failure}"[:300])
    return 1.0
