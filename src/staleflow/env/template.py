"""Tool schemas, tool results and turn boundaries through the model's own chat template.

    fmt = resolve_tool_format(tokenizer, cfg.env.tool_format)          # 'qwen' | 'llama3'
    ids = tool_prompt_ids(tokenizer, messages, env.tools, fmt)         # the prompt, tool schemas included
    obs = observation_tokens(tokenizer, fmt, step.observation, cfg.env.max_observation_tokens)
    eot = end_of_turn_ids(tokenizer)                                   # closes a turn cut at its token cap

``observation_tokens`` are the ids appended after the model's finished turn (which ends with its own
stop token, e.g. ``<|im_end|>`` / ``<|eot_id|>``): whatever the template writes after that token up to
and including the next assistant header, the tool result rendered as the template's tool turn
(role ``tool``; a template that refuses that role gets it as a ``user`` turn). It is read off the
template itself, by rendering a conversation that ends with the observation and taking the text
after the model's turn, so (prompt ids + the model's turn + observation ids) tokenizes like the
template's rendering of the whole conversation with ``add_generation_prompt=True``
(tests/test_tool_call_template.py checks this for SmolLM2's, a Qwen-style and a Llama-3.1-style
template). An observation over ``max_tokens`` is cut, with a visible marker, so the whole stays
within ``max_tokens``.

A template with tool support (it reads ``tools``) renders the schemas itself; one without (SmolLM2's)
gets them in a system prompt, ``fallback_system_prompt`` (docs/multi-turn.md, "Tool formats").
"""

from __future__ import annotations

import json
import re

from staleflow.env.tools import FORMATS, ToolCall, format_tool_call
from staleflow.faults import BadInput

SENTINEL = "staleflow-model-turn-7c1f"
OBSERVATION_SENTINEL = "staleflow-observation-3e9a"
TRUNCATED = "\n[observation truncated: {n} of {total} tokens shown]"


MAX_RENDER_S = 1.0
"""Seconds one chat-template rendering may take (a normal one takes well under a millisecond)."""
MAX_RENDER_STEPS = 300_000
"""Lines the template's own code may execute in one rendering (loop iterations included)."""
MAX_RENDER_GROWTH_MB = 512
"""Memory (peak RSS) one rendering may add."""
MAX_RENDER_CHARS = 4 << 20
"""Characters one rendering may produce."""


class TemplateBudgetError(BadInput, ValueError):
    """A chat template that does not render within its budget (time, steps, memory, recursion, size)."""


def render_chat(tokenizer, messages: list[dict], **kwargs) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`` within a budget: the chat
    template comes with the model folder (whoever provides the model), and Jinja's sandbox bounds
    what it may touch, not how long it runs: nested ``range(100000)`` loops ran for minutes and grew
    to gigabytes, a recursive macro ended in a RecursionError traceback. A trace function follows the
    template's own compiled code (filename ``<template>``) and stops it past MAX_RENDER_STEPS lines,
    MAX_RENDER_S seconds or MAX_RENDER_GROWTH_MB of memory; TemplateBudgetError (one line) then, as for
    a recursion too deep or an output over MAX_RENDER_CHARS. A single operation that allocates at once
    (``'x' * 10**9``) is not seen until it returns (docs/recovery.md)."""
    import resource
    import sys
    import time

    deadline = time.monotonic() + MAX_RENDER_S
    start_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    steps = 0

    def step(frame, event, arg):
        nonlocal steps
        steps += 1
        if steps > MAX_RENDER_STEPS:
            raise TemplateBudgetError(f"ran more than {MAX_RENDER_STEPS} template steps")
        if steps & 4095 == 0:
            if time.monotonic() > deadline:
                raise TemplateBudgetError(f"ran longer than {MAX_RENDER_S:g} s")
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_kb
            if grown > MAX_RENDER_GROWTH_MB << 10:
                raise TemplateBudgetError(f"grew memory by {grown >> 10} MB (> {MAX_RENDER_GROWTH_MB})")
        return step

    def enter(frame, event, arg):
        return step if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateBudgetError as e:
        raise TemplateBudgetError(f"the chat template {e}: {_FIX}") from None
    except RecursionError:
        raise TemplateBudgetError(f"the chat template recursed too deeply (a recursive macro?): {_FIX}") from None
    finally:
        sys.settrace(previous)
    if isinstance(text, str) and len(text) > MAX_RENDER_CHARS:
        raise TemplateBudgetError(f"the chat template rendered {len(text)} characters (> {MAX_RENDER_CHARS}): {_FIX}")
    return text


_FIX = "fix chat_template in the model folder's tokenizer_config.json (or chat_template.jinja), or pass --data.no-chat-template"


def template_text(tokenizer) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("tool_use") or tpl.get("default") or ""
    return tpl or ""


def supports_tools(tokenizer) -> bool:
    """Whether the chat template renders a ``tools=`` argument itself."""
    return "tools" in template_text(tokenizer)


def resolve_tool_format(tokenizer, tool_format: str) -> str:
    """--env.tool-format with 'auto' resolved: llama3 for a template using <|python_tag|> / ipython,
    else qwen (Qwen's own templates, and the fallback for templates without tool support)."""
    if tool_format in FORMATS:
        return tool_format
    if tool_format != "auto":
        raise ValueError(f"tool format {tool_format!r}: use auto, {', '.join(FORMATS)}")
    tpl = template_text(tokenizer)
    return "llama3" if ("<|python_tag|>" in tpl or "ipython" in tpl) else "qwen"


def fallback_system_prompt(tools: list[dict], tool_format: str) -> str:
    """The system prompt describing ``tools`` (OpenAI-style schemas) for a template without tool
    support: the schemas, then one example call of the first tool in ``tool_format``'s syntax (its
    required arguments, each the first of its schema's ``examples`` or a placeholder)."""
    fn = tools[0].get("function", tools[0])
    params = fn.get("parameters", {})
    example = {
        k: (params.get("properties", {}).get(k, {}).get("examples") or [f"<{k}>"])[0]
        for k in params.get("required", [])
    }
    call = format_tool_call(ToolCall(fn.get("name", "<tool name>"), example), tool_format)
    how = (
        "To call a tool, write for example:"
        if tool_format == "qwen"
        else "To call a tool, answer with only JSON, e.g.:"
    )
    schemas = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    return (
        f"You can use these tools:\n{schemas}\n\n{how}\n{call}\n"
        "The tool's result comes back in the next message. When you know the answer, give it without a tool call."
    )


def tool_messages(tokenizer, messages: list[dict], tools: list[dict], tool_format: str) -> tuple[list[dict], dict]:
    """(messages, extra apply_chat_template kwargs) that show ``tools`` to the model: the template's
    own ``tools=`` where it has one, else the fallback system prompt merged into the first system turn."""
    if not tools:
        return list(messages), {}
    if supports_tools(tokenizer):
        return list(messages), {"tools": tools}
    text = fallback_system_prompt(tools, resolve_tool_format(tokenizer, tool_format))
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}


def tool_prompt_ids(tokenizer, messages: list[dict], tools: list[dict], tool_format: str) -> list[int]:
    """The prompt's token ids with the tool schemas shown and the generation prompt added."""
    msgs, extra = tool_messages(tokenizer, messages, tools, tool_format)
    text = render_chat(tokenizer, msgs, add_generation_prompt=True, **extra)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _special_prefix(tokenizer, text: str) -> str:
    """The longest special token ``text`` starts with ('' if none)."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    specials.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return max((s for s in specials if s and text.startswith(s)), key=len, default="")


def _after_model_turn(tokenizer, observation: str) -> tuple[str, str]:
    """(the model's stop token as the template writes it, the text after it up to and including
    the next assistant header), read off a rendering of [user, assistant, tool(observation)]."""
    for role in ("tool", "user"):
        msgs = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": SENTINEL},
            {"role": role, "content": observation},
        ]
        try:
            text = render_chat(tokenizer, msgs, add_generation_prompt=True)
        except TemplateBudgetError:
            raise
        except Exception:  # a template raising on the tool role (jinja raise_exception): try a user turn
            continue
        if SENTINEL in text:
            tail = text[text.index(SENTINEL) + len(SENTINEL) :]
            eot = _special_prefix(tokenizer, tail)
            return eot, tail[len(eot) :]
    raise ValueError("the chat template renders neither a tool nor a user turn after an assistant turn")


def end_of_turn_ids(tokenizer) -> list[int]:
    """The token(s) that end the model's turn in this template (its stop token): appended, as
    environment tokens, to a turn cut at its token cap before observation_tokens."""
    eot, _ = _after_model_turn(tokenizer, "")
    return list(tokenizer(eot, add_special_tokens=False)["input_ids"]) if eot else []


def _special_tokens(tokenizer) -> tuple[list[str], set[int]]:
    """(the special tokens' strings, longest first; their ids): what must never come from a tool's text."""
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    names.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    names.discard("")
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special)
    return sorted(names, key=len, reverse=True), ids


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` read as plain text: a special token's string in it ('<|im_end|>') becomes
    ordinary tokens, never the special id (the tokenizer's split_special_tokens; else the string is
    cut in two, which no special token matches)."""
    _, special = _special_tokens(tokenizer)
    try:
        ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except TypeError:
        ids = None
    if ids is not None and not special.intersection(ids):
        return ids
    if len(text) < 2:
        raise ValueError(f"the tokenizer reads {text!r} only as a special token")
    half = len(text) // 2
    return text_ids(tokenizer, text[:half]) + text_ids(tokenizer, text[half:])


def _tool_turn_ids(tokenizer, observation: str) -> list[int]:
    """The ids of the tool turn holding ``observation`` and the next assistant header: the template's
    framing tokenized as usual, the observation's text as plain text. A tool's output (or a page it
    fetched) holding '<|im_end|>\\n<|im_start|>user' must not close the turn and fake the next one."""
    tail = _after_model_turn(tokenizer, observation)[1]
    names, special = _special_tokens(tokenizer)
    if not any(n in observation for n in names):
        return _ids(tokenizer, tail)  # nothing to neutralise: exactly the template's own tokenization
    frame = _after_model_turn(tokenizer, OBSERVATION_SENTINEL)[1]
    framing = [i for i in _ids(tokenizer, frame) if i in special]
    pre, found, post = frame.partition(OBSERVATION_SENTINEL)
    if found and tail.startswith(pre) and tail.endswith(post) and len(pre) + len(post) <= len(tail):
        pattern = re.compile("|".join(map(re.escape, names)))
        ids, pos = [], 0
        for m in pattern.finditer(tail, len(pre), len(tail) - len(post)):  # only inside the observation
            ids += _ids(tokenizer, tail[pos : m.start()]) + text_ids(tokenizer, m.group())
            pos = m.end()
        ids += _ids(tokenizer, tail[pos:])
        if [i for i in ids if i in special] == framing:
            return ids
    # A template that changes the observation's text (escapes, trims): break every special string in it.
    escaped = observation
    for name in names:
        escaped = escaped.replace(name, name[:1] + "\u200b" + name[1:])
    ids = _ids(tokenizer, _after_model_turn(tokenizer, escaped)[1])
    if [i for i in ids if i in special] != framing:
        raise ValueError("the tool's output renders special tokens through this chat template")
    return ids


def observation_tokens(tokenizer, tool_format: str, observation: str, max_tokens: int) -> list[int]:
    """The ids appended after the model's finished turn: the tool turn holding ``observation`` and
    the next assistant header, at most ``max_tokens`` of them (the observation cut with a marker).
    ``tool_format`` ('auto' allowed) is checked here; the framing is the template's. The observation
    is text: a special token's string in it is tokenized as plain text (_tool_turn_ids)."""
    resolve_tool_format(tokenizer, tool_format)

    def render(text: str) -> list[int]:
        return _tool_turn_ids(tokenizer, text)

    ids = render(observation)
    if len(ids) <= max_tokens:
        return ids
    content = text_ids(tokenizer, observation)
    keep = max(0, max_tokens - (len(ids) - len(content)) - 16)
    while True:
        text = tokenizer.decode(content[:keep]) + TRUNCATED.format(n=keep, total=len(content))
        ids = render(text)
        if len(ids) <= max_tokens:
            return ids
        if keep == 0:
            break
        keep = max(0, keep - max(1, len(ids) - max_tokens))
    raise ValueError(
        f"max_tokens={max_tokens} cannot hold the template's tool turn and the truncation marker: "
        f"raise --env.max-observation-tokens"
    )
