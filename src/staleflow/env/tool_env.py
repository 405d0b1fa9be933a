"""ToolEnv: an environment made of tools, the base of the built-ins (calculator, python).

Each step parses the model's message for tool calls (env/tools.py); no call ends the episode
(done, reward None: the task's reward fn scores the final text); otherwise every call runs, in a
thread of its own (``in_thread``: one slow tool never delays another trajectory's call), and the
results, errors included, are the observation. A malformed call, an unknown tool,
wrong arguments or a tool raising become ``Error: ...`` text the model reads, as agent loops do.
The environment keeps no state between steps beyond the prompt, so an episode is recreated from
the prompt row and the messages so far (docs/multi-turn.md).
"""

from __future__ import annotations

import asyncio
import threading
import time

from staleflow.env.protocol import EnvStep
from staleflow.env.tools import FORMATS, BadCall, Tool, ToolCall, ToolError, parse_tool_calls

MAX_CALLS_PER_STEP = 8
"""Calls past this many in one message are not run; the model reads that they were dropped."""
MAX_TOOL_THREADS = 256
"""Tool calls running at once in one process (timed-out ones still finishing included); past it a call
is refused with an error the model reads."""
_SLOTS = threading.BoundedSemaphore(MAX_TOOL_THREADS)


class ToolsBusy(RuntimeError):
    """Every tool thread is taken (calls that outlived their step's timeout still running)."""


async def in_thread(fn, arguments: dict):
    """``fn(**arguments)`` in a thread of its own, awaited. Not asyncio's shared default pool (a few
    threads: six sleeping calls of other trajectories made an instant call wait past its timeout): one
    slow tool never delays another trajectory's call. A daemon thread: a call abandoned at its step's
    timeout finishes in the background and never holds up the process's exit."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    if not _SLOTS.acquire(blocking=False):
        raise ToolsBusy(f"{MAX_TOOL_THREADS} tool calls are still running here; try again later")

    def settle(value, error) -> None:
        if not done.done():  # cancelled at the step's timeout: the result is dropped
            done.set_exception(error) if error is not None else done.set_result(value)

    def work() -> None:
        value, error = None, None
        try:
            value = fn(**arguments)
        except Exception as e:  # handed to the awaiting step, which makes it the observation
            error = e
        except BaseException as e:  # SystemExit in a tool must not stop the rank's loop
            error = RuntimeError(f"the tool raised {type(e).__name__}: {e}")
        finally:
            _SLOTS.release()
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:
            pass  # the loop is gone (the rank is closing)

    try:
        threading.Thread(target=work, name="staleflow-tool", daemon=True).start()
    except RuntimeError as e:  # can't start new thread: the process's thread limit
        _SLOTS.release()
        raise ToolsBusy(f"cannot start a thread for the tool call ({e}); try again later") from None
    return await done


class ToolEnv:
    """Subclass and set ``tools`` (a tuple of Tool), or pass them; built as ``cls(cfg)``."""

    tools: tuple[Tool, ...] = ()

    def __init__(self, cfg, tools: tuple[Tool, ...] | None = None):
        self.cfg = cfg
        if tools is not None:
            self.tools = tuple(tools)
        self.tool_format = getattr(cfg, "tool_format", "auto")
        """'qwen', 'llama3' or 'auto' (both syntaxes read); the rollout worker may set the resolved one."""
        self.prompt = None

    @property
    def schemas(self) -> list[dict]:
        """The tools' schemas, as a chat template's ``tools=`` takes them (env/template.tool_prompt_ids)."""
        return [t.schema() for t in self.tools]

    async def reset(self, prompt) -> None:
        self.prompt = prompt

    def parse(self, message: str) -> list[ToolCall | BadCall]:
        if self.tool_format in FORMATS:
            return parse_tool_calls(message, self.tool_format)
        return parse_tool_calls(message, "qwen") or parse_tool_calls(message, "llama3")

    async def step(self, message: str) -> EnvStep:
        calls = self.parse(message)
        if not calls:
            return EnvStep(observation="", done=True)
        t0 = time.monotonic()
        results, errors = [], []
        for call in calls[:MAX_CALLS_PER_STEP]:
            text, error = await self.call(call)
            results.append((getattr(call, "name", "?"), text))
            if error:
                errors.append(error)
        if len(calls) > MAX_CALLS_PER_STEP:
            dropped = f"Error: only {MAX_CALLS_PER_STEP} tool calls run per message; {len(calls) - MAX_CALLS_PER_STEP} dropped"
            results.append(("?", dropped))
            errors.append("too many calls")
        if len(results) == 1:
            observation = results[0][1]
        else:
            observation = "\n\n".join(f"[{i}] {name}: {text}" for i, (name, text) in enumerate(results, 1))
        return EnvStep(
            observation=observation,
            done=False,
            tool_calls=len(calls),
            tool_s=time.monotonic() - t0,
            error="; ".join(errors) if errors else None,
        )

    async def call(self, call: ToolCall | BadCall) -> tuple[str, str | None]:
        """(the text the model reads, the error line or None) for one call."""
        if isinstance(call, BadCall):
            return f"Error: {call.error}", call.error
        tool = next((t for t in self.tools if t.name == call.name), None)
        if tool is None:
            error = f"unknown tool {call.name!r}; the tools are {', '.join(t.name for t in self.tools)}"
            return f"Error: {error}", error
        problem = tool.check(call.arguments)
        if problem:
            return f"Error: {problem}", problem
        try:
            return str(await in_thread(tool.fn, call.arguments)), None
        except Exception as e:  # a tool's failure is the model's observation, not the run's
            what = " ".join(str(e).split())
            error = what if isinstance(e, ToolError) else f"{call.name} raised {type(e).__name__}: {what}"
            return f"Error: {error}", error
