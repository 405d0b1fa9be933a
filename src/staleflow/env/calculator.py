"""The ``calculator`` environment: one tool evaluating arithmetic, safely.

The expression is parsed with ``ast`` and walked here: only numbers, + - * / // % **, unary + -
and parentheses; never ``eval``. Sizes are bounded (the text, the number of nodes, integer results
at MAX_INT_BITS bits, exponents checked before computing), so ``9**9**9`` is refused at once
instead of taking the rank's CPU and memory. Anything else (a name, an attribute, a call, a
string) is refused with a one-line reason the model reads.
"""

from __future__ import annotations

import ast
import math
import operator

from staleflow.env.protocol import register_env
from staleflow.env.tool_env import ToolEnv
from staleflow.env.tools import Tool, ToolError

MAX_CHARS = 256
MAX_NODES = 64
MAX_INT_BITS = 4096
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class CalcError(ToolError):
    """An expression the calculator refuses or cannot compute (the message is what the model reads)."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalcError (one line) for anything else.

    >>> calculate("(2 + 3) * 4 ** 2 // 3")
    26
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalcError("give an arithmetic expression such as (2 + 3) * 4")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"not an arithmetic expression ({e.msg})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"the expression has more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalcError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        x = _value(node.operand)
        return x if isinstance(node.op, ast.UAdd) else -x
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _value(node.left), _value(node.right)
        _check_size(node.op, a, b)
        try:
            out = _OPS[type(node.op)](a, b)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("the result is too large") from None
        if isinstance(out, complex):
            raise CalcError("the result is not a real number (a fractional power of a negative number)")
        if isinstance(out, float) and not math.isfinite(out):
            raise CalcError("the result is too large")
        if isinstance(out, int) and out.bit_length() > MAX_INT_BITS:
            raise CalcError("the result is too large")
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalcError("^ is not a power here: write ** (2 ** 3 = 8)")
    what = {ast.Name: "a name", ast.Attribute: "an attribute", ast.Call: "a function call"}.get(type(node))
    raise CalcError(f"{what or type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_size(op: ast.operator, a, b) -> None:
    """Refuse, before computing, an integer operation whose result would exceed MAX_INT_BITS."""
    if not (isinstance(a, int) and isinstance(b, int)):
        if isinstance(op, ast.Pow) and abs(b) > 1e6:
            raise CalcError("the exponent is too large")
        return
    if isinstance(op, ast.Pow) and b > 0 and abs(a) > 1 and a.bit_length() * b > MAX_INT_BITS:
        raise CalcError("the exponent is too large")
    if isinstance(op, ast.Pow) and b < -MAX_INT_BITS:
        raise CalcError("the exponent is too large")
    if isinstance(op, ast.Mult) and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
        raise CalcError("the result is too large")


def format_number(x: int | float) -> str:
    """'5' for 5 and 5.0; up to 12 significant digits for other floats."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.12g}"


def calculator(expression: str) -> str:
    """The tool's function: the value of ``expression`` as text."""
    return format_number(calculate(expression))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    parameters={
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "the arithmetic", "examples": ["(12 + 30) * 2"]}
        },
        "required": ["expression"],
    },
    fn=calculator,
)


@register_env("calculator")
class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool; the episode ends when the model answers without a call."""

    tools = (CALCULATOR,)
