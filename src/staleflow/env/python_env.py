"""The ``python`` environment: one tool running model-written Python in the sandbox.

The code runs through ``staleflow.sandbox.run_python`` (docs/sandbox.md: no network, a private
temporary folder, CPU-time / memory / process / output limits, a wall-clock timeout), imported
when the environment is built; where the sandbox is missing or cannot start, building the
environment fails in one line (``staleflow check`` prints it) rather than running code unsandboxed.
The model reads the program's stdout, its stderr and, when the sandbox stopped it, why.
"""

from __future__ import annotations

import dataclasses
import functools

from staleflow.env.protocol import register_env
from staleflow.env.tool_env import ToolEnv
from staleflow.env.tools import Tool

MAX_STREAM_CHARS = 4000
"""Each of stdout / stderr is cut to this many characters here (the observation cap cuts tokens later)."""


@functools.cache  # the sandbox's probe starts a process: once per rank (a failure raises, so is not cached)
def sandbox_runner():
    """(run_python, SandboxLimits()) from staleflow.sandbox; RuntimeError (one line) where it cannot run."""
    try:
        from staleflow.sandbox import SandboxLimits, run_python, sandbox_unavailable
    except ImportError as e:
        raise RuntimeError(
            f"the python environment needs staleflow.sandbox, which cannot be imported ({e}); "
            f"use --env.name calculator or install the sandbox (docs/sandbox.md)"
        ) from None
    why = sandbox_unavailable()
    if why:
        raise RuntimeError(f"the python environment cannot run code: {why}")
    return run_python, SandboxLimits()


def _cut(text: str) -> str:
    return text if len(text) <= MAX_STREAM_CHARS else text[:MAX_STREAM_CHARS] + f"... [{len(text)} characters]"


def describe(result) -> str:
    """What the model reads of a SandboxResult: stdout, stderr, and why it stopped when it did not finish."""
    parts = []
    if result.stdout:
        parts.append(_cut(result.stdout.rstrip("\n")))
    if result.stderr:
        parts.append("stderr:\n" + _cut(result.stderr.rstrip("\n")))
    if result.reason:
        parts.append(f"[stopped by the sandbox: {result.reason}]")
    elif result.exit_code not in (0, None):
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output: print() what you want to see]"


@register_env("python")
class PythonEnv(ToolEnv):
    """Python code execution as a tool; the episode ends when the model answers without a call.

    ``run_python`` and ``limits`` may be given (tests, forks); else the sandbox's own.
    """

    def __init__(self, cfg, run_python=None, limits=None):
        if run_python is None:
            run_python, default_limits = sandbox_runner()
            limits = default_limits if limits is None else limits
            if dataclasses.is_dataclass(limits) and getattr(limits, "wall_s", 0) > cfg.step_timeout_s:
                # the sandbox stops the program before the step's timeout: the model reads why
                limits = dataclasses.replace(limits, wall_s=0.9 * cfg.step_timeout_s)
        self._run_python, self._limits = run_python, limits
        tool = Tool(
            name="python",
            description="Run a Python program and read what it prints (stdout and stderr). Nothing persists between calls.",
            parameters={
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program; print() the results"}},
                "required": ["code"],
            },
            fn=self.run,
        )
        super().__init__(cfg, tools=(tool,))

    def run(self, code: str) -> str:
        return describe(self._run_python(code, self._limits))
