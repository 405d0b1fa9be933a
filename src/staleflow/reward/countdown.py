"""Countdown: check that an arithmetic expression uses the given numbers and equals the target.

The expression is parsed with ``ast`` and walked by a tiny evaluator over exact fractions:
only integer literals, + - * / and parentheses are accepted (no names, calls, powers, unary
minus), so nothing the model writes is ever executed. Each given number must be used exactly
once (the usual Countdown rule).

    check_countdown("(25 - 5) * 4", numbers=[4, 5, 25], target=80)  -> (True, "ok")
    completion_expression("so \\boxed{(25 - 5) \\times 4 = 80}")    -> "(25 - 5) * 4"
    completion_expression("(25 - 5) * 4 = 80")                      -> "(25 - 5) * 4"  (no box: last expression)
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from staleflow.reward.extract import last_boxed

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
MAX_EXPRESSION_CHARS = 200
_OPERATOR_SPELLINGS = (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("×", "*"), ("÷", "/"), ("−", "-"))
_PLAIN_EXPRESSION = re.compile(r"(?:\(\s*)*\d+(?:[\s)]*[-+*/][\s(]*\d+)+(?:\s*\))*")
"""An arithmetic expression in running text: integers joined by + - * / (at least one), with parentheses.
Single-character classes between mandatory tokens: linear-time matching on any text."""


class CountdownInvalid(ValueError):
    """The expression is not a valid Countdown answer (the message says why)."""


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """(exact value, integer literals used) of an arithmetic expression; CountdownInvalid otherwise."""
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise CountdownInvalid(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise CountdownInvalid(f"not an arithmetic expression: {expr!r}") from None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise CountdownInvalid("division by zero")
            return _OPS[type(node.op)](left, right)
        raise CountdownInvalid(f"only integers, + - * / and parentheses are allowed, got {ast.dump(node)[:60]}")

    return walk(tree.body), used


def check_countdown(expr: str, numbers: list[int], target: int) -> tuple[bool, str]:
    """(correct, reason): expr uses exactly the multiset `numbers` and evaluates to `target`."""
    try:
        value, used = evaluate(expr)
    except CountdownInvalid as e:
        return False, str(e)
    if Counter(used) != Counter(numbers):
        return False, f"uses {sorted(used)}, must use each of {sorted(numbers)} exactly once"
    if value != target:
        return False, f"equals {value}, not the target {target}"
    return True, "ok"


def _normalise(expr: str) -> str:
    for spelling, op in _OPERATOR_SPELLINGS:
        expr = expr.replace(spelling, op)
    return expr


def _balanced(expr: str) -> str:
    """Drop the unmatched '(' at the start and ')' at the end that a regex match picks up from prose."""
    while expr.startswith("(") and expr.count("(") > expr.count(")"):
        expr = expr[1:].lstrip()
    while expr.endswith(")") and expr.count(")") > expr.count("("):
        expr = expr[:-1].rstrip()
    return expr


def last_plain_expression(text: str) -> str | None:
    """The last arithmetic expression written in plain text ("so (25 - 5) * 4 = 80." -> "(25 - 5) * 4").

    The LAST one, not the best one: a completion that lists many candidates gets credit only if its
    final one is right, so listing guesses does not pay.
    """
    found = _PLAIN_EXPRESSION.findall(_normalise(text))
    return _balanced(found[-1].strip()) if found else None


def completion_expression(text: str) -> str | None:
    """The answer expression of a completion, left of any '=': the last non-empty \\boxed{} if there is
    one, else the last <answer></answer>, else the last arithmetic expression in the text."""
    expr = last_boxed(text)
    if expr is None and "<answer>" in text:
        expr = text.rsplit("<answer>", 1)[1].split("</answer>", 1)[0]
    if expr is None:
        return last_plain_expression(text)
    expr = _normalise(expr.split("=")[0])
    return expr.strip().strip("$").strip() or None
