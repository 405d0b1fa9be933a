"""Tool calls through the model's own chat template (issue 40, item 2): the prompt with the tool
schemas, the model's turn and observation_tokens concatenated equal the template's own tokenization
of the whole conversation with add_generation_prompt=True; for SmolLM2's template (no tool support:
the system-prompt fallback), a Qwen2.5-style and a Llama-3.1-style template written here (nothing
is downloaded: the SmolLM2 tokenizer with the Llama header tokens added)."""

from __future__ import annotations

import copy
import functools

import pytest

from staleflow.env import (
    ToolCall,
    end_of_turn_ids,
    format_tool_call,
    observation_tokens,
    parse_tool_calls,
    resolve_tool_format,
    supports_tools,
    tool_messages,
    tool_prompt_ids,
)
from staleflow.env.calculator import CALCULATOR
from staleflow.env.template import TRUNCATED

QWEN_STYLE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}"
    '{% endfor %}{{ \'\\n</tools>\\nCall one with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3.1's shape: header tokens, <|eot_id|>, tool results as an 'ipython' turn whose string content
# is JSON-encoded (the real template's `is iterable` test is true for strings), tools in the system turn.
# Headers end with one newline, not Llama's two: SmolLM2's BPE splits '\n\n' before a letter unlike
# '\n\n' at the end of a text (Llama 3's own pre-tokenizer does not), which would test SmolLM2's BPE
# on a foreign template instead of our framing.
LLAMA_STYLE = (
    "{{- '<|start_header_id|>system<|end_header_id|>\\n' }}"
    '{%- if tools %}{{ \'Environment: ipython\\nRespond with a JSON {"name": ..., "parameters": ...}.\\n\' }}'
    "{% for t in tools %}{{ (t | tojson) + '\\n' }}{% endfor %}{% endif %}{{ '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role in ['tool', 'ipython'] %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n' + (m.content | tojson) + '<|eot_id|>' }}"
    "{%- else %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n' + (m.content | trim) + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n' }}{% endif %}"
)
LLAMA_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


@functools.cache
def _smollm2():
    from staleflow.model.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _tokenizer(style: str):
    """SmolLM2's tokenizer (shared, never changed) or a copy with the Qwen- or Llama-style template."""
    if style == "smollm2":
        return _smollm2()
    tok = copy.deepcopy(_smollm2())
    if style == "qwen":
        tok.chat_template = QWEN_STYLE
    elif style == "llama":
        tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
        tok.chat_template = LLAMA_STYLE
    return tok


@pytest.fixture(scope="module", params=["smollm2", "qwen", "llama"])
def style(request):
    return request.param, _tokenizer(request.param)


EOT = {"smollm2": "<|im_end|>", "qwen": "<|im_end|>", "llama": "<|eot_id|>"}
FORMAT = {"smollm2": "qwen", "qwen": "qwen", "llama": "llama3"}


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_tool_call_format_and_tool_support_detected(style):
    name, tok = style
    assert resolve_tool_format(tok, "auto") == FORMAT[name]
    assert supports_tools(tok) == (name != "smollm2")  # SmolLM2-135M-Instruct's template ignores tools=
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids(EOT[name])]


@pytest.mark.parametrize(
    "observation", ["84", 'line one\nhe said "hi" \\ done', "Error: unknown tool 'calc'; the tools are calculator"]
)
def test_tool_call_render_matches_template_over_two_turns(style, observation):
    """prompt ids + (model turn + eot + observation_tokens) per turn == the template's tokenization of
    the same conversation ending in the generation prompt, after one and after two tool turns."""
    name, tok = style
    fmt = resolve_tool_format(tok, "auto")
    tools = [CALCULATOR.schema()]
    question = [{"role": "user", "content": "What is 12 * 7, plus 5?"}]
    ids = tool_prompt_ids(tok, question, tools, fmt)
    messages, extra = tool_messages(tok, question, tools, fmt)
    eot = tok.convert_tokens_to_ids(EOT[name])
    for turn, expression in enumerate(["12 * 7", "84 + 5"]):
        call = format_tool_call(ToolCall("calculator", {"expression": expression}), fmt)
        said = call if fmt == "llama3" else f"Let me compute it.\n{call}"
        assert parse_tool_calls(said, fmt) == [ToolCall("calculator", {"expression": expression})]
        obs = observation if turn == 0 else "89"
        ids = ids + _ids(tok, said) + [eot] + observation_tokens(tok, "auto", obs, 512)
        messages = [*messages, {"role": "assistant", "content": said}, {"role": "tool", "content": obs}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        assert ids == _ids(tok, text), (name, turn)
        assert text.count(obs) >= 1 or fmt == "llama3"  # llama's template JSON-encodes the observation


def test_tool_call_prompt_shows_the_schema(style):
    name, tok = style
    fmt = resolve_tool_format(tok, "auto")
    text = tok.decode(tool_prompt_ids(tok, [{"role": "user", "content": "2+2?"}], [CALCULATOR.schema()], fmt))
    assert '"calculator"' in text and "expression" in text
    if name == "smollm2":  # the fallback names the call syntax the parser reads
        assert "<tool_call>" in text and text.count("<|im_start|>system") == 1
    no_tools = tok.decode(tool_prompt_ids(tok, [{"role": "user", "content": "2+2?"}], [], fmt))
    assert "calculator" not in no_tools


def test_tool_call_fallback_merges_into_an_existing_system_turn():
    tok = _tokenizer("smollm2")
    msgs, extra = tool_messages(
        tok,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        [CALCULATOR.schema()],
        "qwen",
    )
    assert extra == {} and len(msgs) == 2 and msgs[0]["content"].startswith("Be brief.\n\nYou can use these tools")


def test_tool_call_observation_truncated_with_marker(style):
    name, tok = style
    long = " ".join(f"row{i}" for i in range(600))
    full = observation_tokens(tok, "auto", long, 10_000)
    cut = observation_tokens(tok, "auto", long, 64)
    assert len(full) > 64 and len(cut) <= 64
    text = tok.decode(cut)
    assert TRUNCATED.split("{")[0].strip() in text and "row0" in text and "row599" not in text
    frame = observation_tokens(tok, "auto", "", 64)  # the framing alone: the cut keeps it whole
    assert cut[:2] == frame[:2] and cut[-3:] == frame[-3:] == full[-3:]


def test_tool_call_observation_cap_too_small_is_one_line():
    tok = _tokenizer("smollm2")
    with pytest.raises(ValueError, match="raise --env.max-observation-tokens"):
        observation_tokens(tok, "qwen", "x " * 200, 8)


def test_tool_call_prompt_renderer_shows_the_env_tools():
    """data/render.py: a multi-turn run's prompts carry the tool schemas (env_schemas), rendered as
    tool_prompt_ids renders them; a single-turn run's prompts are unchanged."""
    import dataclasses

    from staleflow.config import DataConfig, EnvConfig
    from staleflow.data.render import PromptRenderer
    from staleflow.env import env_schemas

    tok = _tokenizer("smollm2")
    schemas = env_schemas(EnvConfig(name="calculator"))
    assert schemas == [CALCULATOR.schema()] and env_schemas(EnvConfig()) == []
    data = DataConfig()
    plain = PromptRenderer(data, tok).encode(["What is 2 + 3?"])[0]
    shown = PromptRenderer(data, tok, schemas, "auto").encode(["What is 2 + 3?"])[0]
    assert shown == tool_prompt_ids(tok, PromptRenderer(data, tok).messages("What is 2 + 3?"), schemas, "qwen")
    assert len(shown) > len(plain) and "calculator" not in tok.decode(plain)
    raw = PromptRenderer(dataclasses.replace(data, chat_template=False), tok, schemas).encode(["What is 2 + 3?"])[0]
    assert "<tool_call>" in tok.decode(raw) and tok.decode(raw).rstrip().endswith("What is 2 + 3?")


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
def test_tool_call_fallback_example_is_a_valid_call(fmt):
    """The example call the fallback prompt shows parses, in its format, to a call the tool accepts."""
    from staleflow.env.template import fallback_system_prompt

    text = fallback_system_prompt([CALCULATOR.schema()], fmt)
    example = text.split("\n\n", 1)[1].split("\n", 1)[1].rsplit("\n", 1)[0]  # between the how-to and the last line
    (call,) = parse_tool_calls(example, fmt)
    assert call.name == "calculator" and CALCULATOR.check(call.arguments) is None
    assert CALCULATOR.fn(**call.arguments) == "84"
