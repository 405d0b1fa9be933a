"""Built-in tasks generated on the fly (no download): arithmetic and countdown.

Row k of a task is a pure function of (seed, k): ``TASKS[name](seed, k) -> (text, answer, meta)``.
That makes the task infinite, identical in every process, and resumable from a single counter.
k may be negative: held-out evaluation prompts are rows -1, -2, ... (PromptSource.hold_out).
``--data.source`` also takes a task function of a fork, 'package.module:name' (docs/extending.md).

- arithmetic: "What is 37 + 48? Put the final answer in \\boxed{}." with two-digit sums and
  differences (never negative) and small products; answer is the integer as text. Easy enough
  that SmolLM2-135M-Instruct solves some at the start, hard enough that RL has room to improve.
- countdown: 3 or 4 numbers in [1, 25] and a target reachable with + - * / using each number
  once (built from a random expression tree with exact, non-negative intermediate values);
  answer is one such expression; meta carries ``numbers`` and ``target`` for the reward.
- word-steps: a story of 2 to 4 small changes to one count ("Mia has 14 shells. Then Mia finds 9
  more. Then Mia gives away 5. ..."), asked to be worked out one step a line before the boxed
  answer: SmolLM2-135M-Instruct writes hundreds of tokens on it (it loses count and runs on), the
  long responses (partial rollouts, interrupts, keep-KV) a two-number sum never makes; answer is the
  integer as text (the arithmetic reward scores it); meta carries the number of ``steps``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from staleflow.data.errors import SUFFIXES, DataError
from staleflow.extensions import ExtensionError, Registry, Shape

TaskRow = tuple[str, str, dict]
"""(prompt text, answer as text, meta): meta goes to the reward function with the answer."""
TaskFn = Callable[[int, int], TaskRow]
"""fn(seed, index) -> TaskRow: a pure function of its arguments (every process draws the same rows)."""


class TaskError(ExtensionError, DataError):
    """--data.source names no registered task, data file or importable task function."""


TASKS: Registry[TaskFn] = Registry(
    "task",
    "--data.source",
    Shape.function(2, "fn(seed, index) -> (prompt text, answer, meta dict)"),
    error=TaskError,
    also="a .jsonl / .parquet / .json file, a save_to_disk folder or a cached Hugging Face dataset",
)
register_task = TASKS.register
"""Decorator: make a task function available as --data.source NAME."""


def task_for(source: str) -> TaskFn | None:
    """The task function --data.source names (a registered task or 'package.module:name'), None for a
    data source (a file, a save_to_disk folder or a Hugging Face dataset name: data/hf.py)."""
    if source in TASKS or (":" in source and "/" not in source and Path(source).suffix not in SUFFIXES):
        return TASKS.resolve(source)
    return None


def _rng(task: str, seed: int, index: int) -> random.Random:
    # A str seed is hashed with SHA-512 by random.Random: stable across processes and runs.
    return random.Random(f"{task}:{seed}:{index}")


def _arithmetic(
    task: str, seed: int, index: int, add: tuple[int, int], sub: tuple[int, int], mul: tuple[int, int]
) -> TaskRow:
    rng = _rng(task, seed, index)
    op = rng.choices("+-*", weights=(4, 3, 3))[0]
    if op == "+":
        a, b = rng.randint(*add), rng.randint(*add)
        value = a + b
    elif op == "-":
        a = rng.randint(*sub)
        b = rng.randint(1, a)
        value = a - b
    else:
        a, b = rng.randint(*mul), rng.randint(*mul)
        value = a * b
    text = f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."
    return text, str(value), {"task": task}


@register_task("arithmetic")
def arithmetic_row(seed: int, index: int) -> TaskRow:
    """Two-digit sums and differences, products up to 12 x 12."""
    return _arithmetic("arithmetic", seed, index, add=(10, 99), sub=(20, 99), mul=(2, 12))


@register_task("arithmetic-easy")
def arithmetic_easy_row(seed: int, index: int) -> TaskRow:
    """Sums of numbers up to 30, differences from up to 50, products up to 9 x 9: the level where
    SmolLM2-135M is right about half the time, so a few RL steps have room to sharpen it."""
    return _arithmetic("arithmetic-easy", seed, index, add=(2, 30), sub=(5, 50), mul=(2, 9))


def _combine(rng: random.Random, left: tuple[Fraction, str], right: tuple[Fraction, str]):
    """A random op joining two sub-expressions, keeping every value a non-negative integer."""
    (a, ea), (b, eb) = left, right
    choices = [(a + b, f"{ea} + {eb}"), (a * b, f"{ea} * {eb}")]
    if a >= b:
        choices.append((a - b, f"{ea} - {eb}"))
    if b != 0 and a % b == 0:
        choices.append((a / b, f"{ea} / {eb}"))
    value, expr = rng.choice(choices)
    return value, f"({expr})"


@register_task("countdown")
def countdown_row(seed: int, index: int) -> TaskRow:
    rng = _rng("countdown", seed, index)
    while True:  # rejection sampling; the expected number of tries is small
        numbers = [rng.randint(1, 25) for _ in range(rng.choice((3, 4)))]
        items = [(Fraction(n), str(n)) for n in numbers]
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            joined = _combine(rng, items[i], items[j])
            items = [x for k, x in enumerate(items) if k not in (i, j)] + [joined]
        target, expr = items[0]
        if 1 <= target <= 500:
            break
    shown = sorted(numbers, key=lambda _: rng.random())
    text = (
        f"Using the numbers {shown}, write an arithmetic expression that equals {int(target)}. "
        "Use each number exactly once, with only + - * / and parentheses. "
        "Put the final expression in \\boxed{}."
    )
    return text, expr[1:-1], {"task": "countdown", "numbers": shown, "target": int(target)}


_NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Ada", "Tom")
_THINGS = ("shells", "marbles", "stickers", "coins", "books", "apples", "cards", "stones")


def _word_step(rng: random.Random, value: int) -> tuple[int, str]:
    """One change to the count, as a sentence: small numbers, never negative."""
    choices = [("add", rng.randint(1, 9))]
    if value >= 2:
        choices.append(("sub", rng.randint(1, min(value - 1, 9))))
    if value <= 20:
        choices.append(("mul", 2))
    if value % 2 == 0:
        choices.append(("div", 2))
    kind, k = rng.choice(choices)
    if kind == "add":
        return value + k, rng.choice((f"finds {k} more", f"is given {k} more", f"buys {k} more"))
    if kind == "sub":
        return value - k, rng.choice((f"gives away {k}", f"loses {k}", f"trades away {k}"))
    if kind == "mul":
        return value * 2, "doubles the pile"
    return value // 2, "gives half of them to a friend"


@register_task("word-steps")
def word_steps_row(seed: int, index: int) -> TaskRow:
    """2 to 4 small changes to one count, to be worked out step by step (long responses)."""
    rng = _rng("word-steps", seed, index)
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    value = rng.randint(2, 20)
    sentences = [f"{name} has {value} {thing}."]
    steps = rng.randint(2, 4)
    for _ in range(steps):
        value, said = _word_step(rng, value)
        sentences.append(f"Then {name} {said}.")
    text = (
        " ".join(sentences) + f" How many {thing} does {name} have at the end? Work it out one step per "
        "line, writing each new count, then put the final answer in \\boxed{}."
    )
    return text, str(value), {"task": "word-steps", "steps": steps}
