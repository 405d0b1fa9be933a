"""Tools and tool calls in the model's own syntax.

    calls = parse_tool_calls(message, "qwen")        # [ToolCall | BadCall, ...]; [] = no call (an answer)
    text = format_tool_call(ToolCall("calculator", {"expression": "2+3"}), "llama3")
    problem = tool.check(call.arguments)             # None, or what is wrong with the arguments

Formats (docs/multi-turn.md, "Tool formats"):
- ``qwen`` (Qwen2.5 / Qwen3, Hermes-style): any number of ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`` blocks in the message, text around them allowed.
- ``llama3`` (Llama 3.1 custom tools): the whole message is one JSON object ``{"name": ...,
  "parameters": {...}}`` (several separated by ';' are accepted); or ``<|python_tag|>`` followed by
  such JSON, or by Python code, which is a call of the tool ``python`` with ``{"code": ...}``.

A call that cannot be read (bad JSON, no name, arguments not an object, an unclosed tag) is a
``BadCall`` carrying the error, which the environment returns as the observation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

FORMATS = ("qwen", "llama3")
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "</s>")
"""End-of-turn tokens a decoded message may still carry; removed before parsing."""
PYTHON_TAG = "<|python_tag|>"
_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


class ToolError(ValueError):
    """What a tool raises for bad input: its message is what the model reads, as is."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BadCall:
    """A call the model tried to make and got wrong; ``error`` is what it reads back."""

    error: str
    text: str = ""


@dataclass(frozen=True)
class Tool:
    """A tool: a name, a description, a JSON schema of its parameters, and the function it runs.

    ``fn(**arguments) -> str`` is synchronous (the environment runs it in a thread); what it raises
    becomes the observation ``Error: ...`` (a ToolError's message as is, else with the exception's type).
    """

    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments: {"type": "object", "properties": {...}, "required": [...]}."""
    fn: Callable[..., str]

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates take as ``tools=``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check(self, arguments: dict) -> str | None:
        """What is wrong with ``arguments`` for this tool (one line), or None."""
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"tool {self.name!r} needs the argument(s) {', '.join(missing)}"
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return f"tool {self.name!r} has no argument(s) {', '.join(unknown)}; it takes {', '.join(props) or 'none'}"
        for k, v in arguments.items():
            want = props[k].get("type")
            kind = _JSON_TYPES.get(want)
            if kind and (not isinstance(v, kind) or (isinstance(v, bool) and want != "boolean")):
                return f"tool {self.name!r}: argument {k!r} must be of JSON type {want}, got {type(v).__name__}"
        return None


def strip_end(message: str) -> str:
    """The message without trailing end-of-turn markers and whitespace."""
    text = message.rstrip()
    changed = True
    while changed:
        changed = False
        for marker in END_MARKERS:
            if text.endswith(marker):
                text, changed = text[: -len(marker)].rstrip(), True
    return text


def parse_tool_calls(message: str, tool_format: str) -> list[ToolCall | BadCall]:
    """The calls in one model message, in order; [] when it makes none (the model answered)."""
    if tool_format not in FORMATS:
        raise ValueError(f"tool format {tool_format!r}: use one of {', '.join(FORMATS)}")
    text = strip_end(message)
    return _parse_qwen(text) if tool_format == "qwen" else _parse_llama3(text)


def _parse_qwen(text: str) -> list[ToolCall | BadCall]:
    calls: list[ToolCall | BadCall] = [_from_json(m.group(1), "arguments") for m in _QWEN_CALL.finditer(text)]
    rest = _QWEN_CALL.sub("", text)
    if "<tool_call>" in rest:
        calls.append(BadCall("a <tool_call> is not closed by </tool_call>", rest[rest.index("<tool_call>") :]))
    return calls


def _parse_llama3(text: str) -> list[ToolCall | BadCall]:
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG) :].strip()
        if not body.startswith("{"):
            return [ToolCall("python", {"code": body})] if body else [BadCall("<|python_tag|> with no code after it")]
    elif not (body.startswith("{") and body.endswith("}") and '"name"' in body):
        return []  # prose (perhaps quoting JSON): an answer, not a call
    return [_from_json(part, "parameters") for part in _split_json(body)]


def _split_json(body: str) -> list[str]:
    """'{...}; {...}' -> each object's text (a ';' inside a string does not split)."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


MAX_CALL_CHARS = 1 << 20
"""A tool call's JSON longer than this is not parsed (a BadCall)."""
MAX_CALL_DEPTH = 64
"""Nesting past this many brackets is not parsed (a BadCall): json would recurse once per level."""


def _too_deep(text: str) -> bool:
    depth = deepest = 0
    quoted = escaped = False
    for ch in text:
        if quoted:
            escaped, quoted = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_CALL_DEPTH:
                return True
        elif ch in "}]":
            depth -= 1
    return False


def _from_json(text: str, key: str) -> ToolCall | BadCall:
    """One call's JSON -> ToolCall, or a BadCall saying what is wrong; never raises (a model's text)."""
    if len(text) > MAX_CALL_CHARS:
        return BadCall(f"the tool call is {len(text)} characters, more than {MAX_CALL_CHARS}", text[:200].strip())
    if _too_deep(text):
        return BadCall(f"the tool call nests more than {MAX_CALL_DEPTH} brackets deep", text[:200].strip())
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BadCall(f"the tool call is not valid JSON ({e.msg} at character {e.pos})", text.strip())
    except (RecursionError, ValueError) as e:  # nested too deeply for the parser, a huge number
        return BadCall(f"the tool call is not valid JSON ({type(e).__name__})", text[:200].strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return BadCall('a tool call is a JSON object with a "name" string', text.strip())
    args = obj.get(key, obj.get("arguments" if key == "parameters" else "parameters", {}))
    if isinstance(args, str) and not _too_deep(args):  # some models send the arguments JSON-encoded once more
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        return BadCall(f'the "{key}" of a tool call must be a JSON object', text.strip())
    return ToolCall(obj["name"], args)


def format_tool_call(call: ToolCall, tool_format: str) -> str:
    """The text a model writes to make ``call`` (what parse_tool_calls reads back)."""
    if tool_format == "qwen":
        return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"
    if tool_format == "llama3":
        return json.dumps({"name": call.name, "parameters": call.arguments})
    raise ValueError(f"tool format {tool_format!r}: use one of {', '.join(FORMATS)}")
