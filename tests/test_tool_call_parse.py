"""Tool-call syntax (issue 40, item 2): the Qwen2.5/Qwen3 <tool_call> blocks and Llama 3.1's JSON /
<|python_tag|> forms, parsed and rendered back; malformed calls are BadCalls carrying the error;
a tool's argument check."""

from __future__ import annotations

import pytest

from staleflow.env import BadCall, Tool, ToolCall, format_tool_call, parse_tool_calls
from staleflow.env.calculator import CALCULATOR

CALLS = [
    ToolCall("calculator", {"expression": "(2 + 3) * 4"}),
    ToolCall("search", {"query": 'say "hi"; then \\ leave', "k": 3, "exact": True, "tags": ["a", "é"]}),
    ToolCall("python", {"code": "for i in range(3):\n    print({i: [i]})"}),
    ToolCall("noargs", {}),
]


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_tool_call_round_trip(fmt, call):
    text = format_tool_call(call, fmt)
    assert parse_tool_calls(text, fmt) == [call]
    assert parse_tool_calls(text + "<|im_end|>", fmt) == [call]  # a decoded turn may keep its stop token


def test_tool_call_qwen_several_per_message_with_text_around():
    text = "I will compute both.\n" + "\n".join(format_tool_call(c, "qwen") for c in CALLS[:3]) + "\nDone."
    assert parse_tool_calls(text, "qwen") == CALLS[:3]
    compact = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    assert parse_tool_calls(compact, "qwen") == [ToolCall("calculator", {"expression": "1+1"})]


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
def test_tool_call_answer_is_no_call(fmt):
    for text in ["The answer is 20.", "", "Use {braces} freely: 20", 'The JSON {"name": "x"} is an example.']:
        assert parse_tool_calls(text, fmt) == [], text


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}\n</tool_call>', "not valid JSON"),
        ("<tool_call>\n{'name': 'calculator'}\n</tool_call>", "not valid JSON"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '"name" string'),
        ('<tool_call>\n["calculator"]\n</tool_call>', '"name" string'),
        ('<tool_call>\n{"name": "calculator", "arguments": [1, 2]}\n</tool_call>', "must be a JSON object"),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}', "not closed"),
    ],
)
def test_tool_call_qwen_malformed_is_a_bad_call(text, error):
    (got,) = parse_tool_calls(text, "qwen")
    assert isinstance(got, BadCall) and error in got.error and "\n" not in got.error


def test_tool_call_qwen_good_and_bad_calls_keep_their_order():
    text = format_tool_call(CALLS[0], "qwen") + "<tool_call>{oops}</tool_call>" + format_tool_call(CALLS[3], "qwen")
    got = parse_tool_calls(text, "qwen")
    assert got[0] == CALLS[0] and isinstance(got[1], BadCall) and got[2] == CALLS[3]


def test_tool_call_llama3_forms():
    one = '{"name": "calculator", "parameters": {"expression": "7*6"}}'
    assert parse_tool_calls(one, "llama3") == [ToolCall("calculator", {"expression": "7*6"})]
    # "arguments" instead of "parameters", a "type" key, and arguments JSON-encoded once more are read too
    other = '{"type": "function", "name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}'
    assert parse_tool_calls(other, "llama3") == [ToolCall("calculator", {"expression": "1"})]
    tagged = "<|python_tag|>" + one + "<|eom_id|>"
    assert parse_tool_calls(tagged, "llama3") == [ToolCall("calculator", {"expression": "7*6"})]
    two = one + '; {"name": "search", "parameters": {"query": "a;b"}}'
    assert parse_tool_calls(two, "llama3") == [
        ToolCall("calculator", {"expression": "7*6"}),
        ToolCall("search", {"query": "a;b"}),
    ]
    code = "<|python_tag|>import math\nprint(math.sqrt(2))<|eom_id|>"
    assert parse_tool_calls(code, "llama3") == [ToolCall("python", {"code": "import math\nprint(math.sqrt(2))"})]


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"name": "calculator", "parameters": {"expression": "1"}', "not valid JSON"),
        ('{"name": 3, "parameters": {}}', '"name" string'),
        ('{"name": "calculator", "parameters": "x"}', "must be a JSON object"),
        ("<|python_tag|>", "no code"),
    ],
)
def test_tool_call_llama3_malformed_is_a_bad_call(text, error):
    (got,) = parse_tool_calls(text, "llama3")
    assert isinstance(got, BadCall) and error in got.error


def test_tool_call_unknown_format_refused():
    with pytest.raises(ValueError, match="qwen, llama3"):
        parse_tool_calls("x", "hermes")
    with pytest.raises(ValueError, match="qwen, llama3"):
        format_tool_call(CALLS[0], "auto")


def test_tool_call_arguments_checked_against_the_schema():
    assert CALCULATOR.check({"expression": "1+1"}) is None
    assert "needs the argument(s) expression" in CALCULATOR.check({})
    assert "has no argument(s) expr" in CALCULATOR.check({"expression": "1", "expr": "2"})
    assert "must be of JSON type string, got int" in CALCULATOR.check({"expression": 5})
    counted = Tool("count", "", {"type": "object", "properties": {"n": {"type": "integer"}}}, fn=str)
    assert counted.check({"n": 3}) is None and "must be of JSON type integer, got bool" in counted.check({"n": True})
    assert counted.schema()["function"]["name"] == "count" and counted.schema()["type"] == "function"
