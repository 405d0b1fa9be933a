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

from staleflow.env.tools import FORMATS, ToolCall, format_tool_call

SENTINEL = "staleflow-model-turn-7c1f"
TRUNCATED = "\n[observation truncated: {n} of {total} tokens shown]"


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
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **extra)
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
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
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


def observation_tokens(tokenizer, tool_format: str, observation: str, max_tokens: int) -> list[int]:
    """The ids appended after the model's finished turn: the tool turn holding ``observation`` and
    the next assistant header, at most ``max_tokens`` of them (the observation cut with a marker).
    ``tool_format`` ('auto' allowed) is checked here; the framing is the template's."""
    resolve_tool_format(tokenizer, tool_format)

    def render(text: str) -> list[int]:
        return list(tokenizer(_after_model_turn(tokenizer, text)[1], add_special_tokens=False)["input_ids"])

    ids = render(observation)
    if len(ids) <= max_tokens:
        return ids
    content = list(tokenizer(observation, add_special_tokens=False)["input_ids"])
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
