"""Multi-turn environments and tool calls (docs/multi-turn.md).

protocol.py: Environment, EnvStep, the ENVS registry, make_env, run_step (the per-step timeout).
tools.py: Tool, ToolCall, BadCall, parse_tool_calls / format_tool_call (qwen and llama3 syntax).
template.py: tool schemas in the prompt and observation_tokens through the model's chat template.
tool_env.py: ToolEnv, an environment made of tools; calculator.py and python_env.py, the built-ins.
"""

from staleflow.env import calculator, python_env  # noqa: F401  (each registers its environment)
from staleflow.env.protocol import (
    ENVS,
    Environment,
    EnvStep,
    env_class,
    env_failure,
    env_schemas,
    make_env,
    register_env,
    run_step,
)
from staleflow.env.template import (
    end_of_turn_ids,
    observation_tokens,
    resolve_tool_format,
    supports_tools,
    tool_messages,
    tool_prompt_ids,
)
from staleflow.env.tools import BadCall, Tool, ToolCall, ToolError, format_tool_call, parse_tool_calls

__all__ = [
    "ENVS",
    "BadCall",
    "EnvStep",
    "Environment",
    "Tool",
    "ToolCall",
    "ToolError",
    "end_of_turn_ids",
    "env_class",
    "env_failure",
    "env_schemas",
    "format_tool_call",
    "make_env",
    "observation_tokens",
    "parse_tool_calls",
    "register_env",
    "resolve_tool_format",
    "run_step",
    "supports_tools",
    "tool_messages",
    "tool_prompt_ids",
]
