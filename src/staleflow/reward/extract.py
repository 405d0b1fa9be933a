"""Answer extraction from completion text: the last ``\\boxed{...}`` and the final number.

Pure string functions shared by the built-in rewards and the format reward:

    last_boxed("so \\boxed{\\frac{1}{2}}.")   -> "\\frac{1}{2}"
    final_number("37 + 48 = 85, done")        -> "85"

The rule every built-in reward follows: when a completion has a non-empty box, the last one IS
its answer (text elsewhere is working); only a completion without one is read by a fallback
(the last number, math-verify's final-answer extraction, the last expression).
"""

from __future__ import annotations

import re

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def all_boxed(text: str) -> list[str]:
    """Contents of every balanced ``\\boxed{...}`` / ``\\fbox{...}`` in order (nested braces kept)."""
    found: list[tuple[int, str]] = []
    for opener in _BOX_OPENERS:
        start = text.find(opener)
        while start != -1:
            i, depth = start + len(opener), 1
            while i < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
            if depth == 0:  # an unclosed box is not an answer
                found.append((start, text[start + len(opener) : i - 1]))
            start = text.find(opener, start + 1)
    return [content for _, content in sorted(found)]


def last_boxed(text: str) -> str | None:
    """Content of the last balanced, non-empty ``\\boxed{}`` in text, stripped; None if there is none.

    An empty box holds no answer, so ``\\boxed{} 85`` is read as unboxed (by the fallback).
    """
    boxes = [b.strip() for b in all_boxed(text) if b.strip()]
    return boxes[-1] if boxes else None


def final_number(text: str) -> str | None:
    """The last number written in text ("1,234" -> "1234"), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def parse_int(text: str) -> int | None:
    """An integer written as text ("85", " -3 ", "1,200", "85.0", "$85$"), else None."""
    cleaned = text.strip().strip("$").strip().rstrip(".").replace(",", "").replace(" ", "")
    if re.fullmatch(r"-?\d+", cleaned):
        return int(cleaned)
    if re.fullmatch(r"-?\d+\.0+", cleaned):
        return int(cleaned.split(".")[0])
    return None
