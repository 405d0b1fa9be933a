"""The environment protocol: what a multi-turn trajectory talks to between the model's turns.

    env = make_env(cfg.env)                          # --env.name: calculator | python | pkg.module:Class
    env_schemas(cfg.env)                             # the tool schemas the prompt shows (data/render.py)
    await env.reset(prompt)                          # a fresh episode from the prompt's data row
    step = await run_step(env, message, timeout_s)   # the model's finished turn -> EnvStep
    step.observation, step.done, step.reward, step.tool_calls, step.tool_s, step.error

An environment is a class built as ``cls(cfg)`` (cfg: the run's EnvConfig), one instance per
trajectory, with two coroutines: ``reset(prompt)`` and ``step(message) -> EnvStep``, and optionally
``schemas``, the tools' JSON schemas the prompt shows. ``ENVS`` is its
registry (staleflow.extensions): the built-ins register themselves (env/calculator.py,
env/python_env.py) with the interface a fork implements, and ``--env.name my_pkg.envs:MyEnv`` loads a
fork's through the same path as ``--train.loss``. An environment's state must be recreatable from the
prompt row and the messages so far (a trajectory interrupted while a tool runs is resumed, on any
instance, by a new instance replaying its messages): docs/multi-turn.md. Pure: no torch.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from staleflow.extensions import ExtensionError, Registry, Shape, one_line


@dataclass(frozen=True)
class EnvStep:
    """What the environment answers to one model turn.

    >>> EnvStep("4", done=False, tool_calls=1).reward is None
    True
    """

    observation: str
    """Text the model reads next (rendered as the template's tool turn); '' when done."""
    done: bool
    """The episode is over: no further turn (the model answered without a tool call, or the env ended it)."""
    reward: float | None = None
    """A reward from the environment itself; None: the task's reward fn scores the final text."""
    tool_calls: int = 0
    """Tool calls made in this step (malformed ones included)."""
    tool_s: float = 0.0
    """Seconds the step's tools took."""
    error: str | None = None
    """What went wrong in this step, one short line (a malformed call, a tool error, 'timeout'), else None."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (docs/multi-turn.md, "Writing an environment")."""

    async def reset(self, prompt) -> None:
        """Start an episode for ``prompt`` (a staleflow.trajectory.Prompt: text, answer, meta)."""

    async def step(self, message: str) -> EnvStep:
        """The model's finished turn (its decoded text) -> the observation and whether it is done."""


ENVS: Registry[type] = Registry(
    "environment",
    "--env.name",
    Shape.klass(
        1,
        "class (cfg: EnvConfig) with async reset(prompt) and async step(message) -> EnvStep "
        "(staleflow.env.Environment; docs/multi-turn.md)",
        methods=(("reset", 1), ("step", 1)),
    ),
)
"""name -> environment class; the built-ins are calculator and python."""


def register_env(name: str):
    """Decorator: make an environment class available as ``--env.name NAME``."""
    return ENVS.register(name)


def env_class(spec: str) -> type:
    """The class --env.name names (ExtensionError, one line, when it does not resolve). Import it
    from the package (``staleflow.env``), which registers the built-ins."""
    return ENVS.resolve(spec)


def make_env(cfg) -> Environment:
    """A new environment for one trajectory, built as ``cls(cfg)`` from the run's EnvConfig;
    ExtensionError (one line naming the flag) when the class cannot be built."""
    cls = env_class(cfg.name)
    try:
        env = cls(cfg)
    except ExtensionError:
        raise
    except Exception as e:  # a fork's constructor may raise anything; the message names the flag
        raise ExtensionError(
            f"--env.name={cfg.name!r}: {cls.__name__}(cfg) failed ({type(e).__name__}: {one_line(e)}); "
            f"an environment is {ENVS.shape.text}"
        ) from None
    for name in ("reset", "step"):
        if not inspect.iscoroutinefunction(getattr(env, name)):
            raise ExtensionError(
                f"--env.name={cfg.name!r}: {cls.__name__}.{name} is not a coroutine function (async def); "
                f"an environment is {ENVS.shape.text}"
            )
    return env


def env_schemas(cfg) -> list[dict]:
    """The tool schemas the prompt shows for the run's EnvConfig: the environment's optional ``schemas``
    attribute (OpenAI-style function schemas, what a chat template's ``tools=`` takes); [] for a
    single-turn run (--env.name '') or an environment without one."""
    if not cfg.name:
        return []
    schemas = getattr(make_env(cfg), "schemas", None) or []
    if not isinstance(schemas, list) or not all(isinstance(s, dict) for s in schemas):
        raise ExtensionError(f"--env.name={cfg.name!r}: its schemas must be a list of dicts (tool JSON schemas)")
    return schemas


async def run_step(env: Environment, message: str, timeout_s: float) -> EnvStep:
    """``env.step(message)`` under the per-step timeout; never raises for anything the message or the
    environment does (nothing a model writes may end a rank). Past ``timeout_s`` seconds the step is
    cancelled and the model reads an observation saying so (error 'timeout', done False). A tool
    running in a thread cannot be killed: it finishes in the background and its result is dropped
    (the sandbox has its own wall-clock limit). A step that raises, or returns something that is not
    an EnvStep, is an error observation too (error 'environment: Type: message', done False), logged
    as a warning: the episode goes on, bounded by --env.max-turns. Only a cancellation propagates."""
    t0 = time.monotonic()
    try:
        step = await asyncio.wait_for(env.step(message), timeout_s)
    except TimeoutError:
        return EnvStep(
            observation=f"Error: the tool call timed out after {timeout_s:g} s and was stopped.",
            done=False,
            tool_calls=1,
            tool_s=time.monotonic() - t0,
            error="timeout",
        )
    except Exception as e:  # a fork's environment, or a message no parser foresaw: the model reads it
        return env_failure(env, f"{type(e).__name__}: {one_line(e)[:200]}", time.monotonic() - t0)
    if not isinstance(step, EnvStep):
        return env_failure(env, f"step returned {type(step).__name__}, not an EnvStep", time.monotonic() - t0)
    return step


def env_failure(env, what: str, seconds: float = 0.0) -> EnvStep:
    """The observation for an environment that failed on a message (logged once per distinct failure)."""
    line = f"environment: {type(env).__name__} {what}"
    if line not in _LOGGED and len(_LOGGED) < 64:
        _LOGGED.add(line)
        log.warning("%s; the model reads it as an error observation", line)
    return EnvStep(
        observation="Error: the environment could not handle this message; try again differently.",
        done=False,
        tool_s=seconds,
        error=line,
    )


_LOGGED: set[str] = set()
log = logging.getLogger("staleflow.env")
