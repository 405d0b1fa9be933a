"""Reward functions by name: the built-ins (arithmetic, math, countdown), the format reward and
user functions given by import path.

Every reward function has the signature ``fn(completion_text, answer, meta) -> float``:

    fn = resolve_reward_fn("math")                 # or "arithmetic", "countdown", "my_pkg.rewards:f"
    reward, info = score(fn, "... \\boxed{\\frac12}", "0.5", {}, format_weight=0.1)

``score`` returns ``answer_reward + format_weight * format_reward``, where the format reward is 1
only for a CORRECT answer (answer_reward >= 1) written in a non-empty \\boxed{}. A format bonus
that a wrong answer could collect is a reward for the box itself: the policy learns to box garbage
(``\\boxed{66 broke}``) and stops doing arithmetic. Gated on correctness, a wrong answer scores
its answer reward and nothing more, so for any function that gives wrong answers less than 1 a
wrong boxed answer never scores above a right unboxed one, whatever the weight.

``score`` never raises: a function that raises yields reward 0 with the error recorded in
``info["error"]``. Timeouts are enforced by the RewardPool (reward/pool.py), which runs ``score``
in worker processes.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Callable

from staleflow.extensions import ExtensionError, Registry, Shape
from staleflow.reward.countdown import check_countdown, completion_expression
from staleflow.reward.extract import final_number, last_boxed, parse_int

RewardFn = Callable[[str, str, dict], float]
"""fn(completion_text, answer, meta) -> float: the answer reward of one completion (meta: the data
row's other fields); raising or returning a non-finite number scores 0 and is counted as a failure."""
FULL_CREDIT = 1.0
"""The answer reward of a correct answer; only completions scoring at least this earn the format bonus."""


class RewardError(ExtensionError):
    """A reward function cannot be resolved (unknown name, bad import path, not callable)."""


class NoCredit(Exception):
    """Raised by a reward function for a zero that is the completion's fault, not the function's:
    ``score`` gives 0 with the message in info["reason"] (not counted as a reward error)."""


REWARDS: Registry[RewardFn] = Registry(
    "reward", "--reward.fn", Shape.function(3, "fn(completion, answer, meta) -> float"), error=RewardError
)
register_reward = REWARDS.register
"""Decorator: make a reward function available as --reward.fn NAME."""


def format_reward(completion: str, answer_reward: float) -> float:
    """1.0 for a correct answer (answer_reward >= FULL_CREDIT) in a non-empty \\boxed{}, else 0.0.

    The built-in rewards read the last box as THE answer when there is one, so "correct and
    boxed" means the box itself holds the right answer: garbage in a box is a wrong answer and
    earns nothing.
    """
    return 1.0 if answer_reward >= FULL_CREDIT and last_boxed(completion) is not None else 0.0


@register_reward("arithmetic")
def arithmetic_reward(completion: str, answer: str, meta: dict) -> float:
    """1.0 if the boxed integer (or, with no box, the last number written) equals the answer.

    A box holding anything but one integer (``\\boxed{66 broke}``, ``\\boxed{58 + 66}``) is a wrong
    answer, even if the right number appears elsewhere: the box is what the completion answered.
    """
    gold = parse_int(str(answer))
    if gold is None:
        raise ValueError(f"arithmetic reward needs an integer answer, got {answer!r}")
    boxed = last_boxed(completion)
    said = parse_int(boxed) if boxed is not None else parse_int(final_number(completion) or "")
    return 1.0 if said == gold else 0.0


def _math_verify_timeout() -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread of a process.
    return 5 if threading.current_thread() is threading.main_thread() else None


@register_reward("math")
def math_reward(completion: str, answer: str, meta: dict) -> float:
    """1.0 if math-verify finds the completion's answer equivalent to the reference.

    The answer is the last non-empty box alone when there is one (math-verify on the whole text
    would fall back to a number outside a box it cannot parse, crediting garbage in the box);
    without a box, math-verify's own final-answer extraction on the whole completion.
    """
    from math_verify import parse, verify

    limit = _math_verify_timeout()
    gold = parse(str(answer), parsing_timeout=limit)
    if not gold:
        gold = parse(f"${answer}$", parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    boxed = last_boxed(completion)
    pred = parse(completion if boxed is None else f"\\boxed{{{boxed}}}", parsing_timeout=limit)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0


@register_reward("countdown")
def countdown_reward(completion: str, answer: str, meta: dict) -> float:
    """1.0 if the answer expression uses meta['numbers'] exactly once each and equals meta['target'].

    The expression is the last box, else the last <answer></answer>, else the last arithmetic
    expression in the text (countdown.completion_expression).
    """
    if "numbers" not in meta or "target" not in meta:
        raise ValueError("countdown reward needs meta['numbers'] and meta['target'] (fields of the data row)")
    expr = completion_expression(completion)
    if expr is None:
        return 0.0
    ok, _ = check_countdown(expr, [int(n) for n in meta["numbers"]], int(meta["target"]))
    return 1.0 if ok else 0.0


def answer_problem(spec: str, answer: str, meta: dict | None = None) -> str | None:
    """Why the reward `spec` can never score a dataset answer (None: it can). Checked when the
    data is loaded, so an unscorable row is reported with its row number instead of failing at
    every reward call: e.g. ``\\frac{5}{2}`` under the integer ``arithmetic`` reward, or a countdown
    row (its answer is one expression of many; the row's numbers and target decide) under any reward
    but ``countdown`` (``math`` would pay for writing the target alone)."""
    meta = meta or {}
    if meta.get("task") == "countdown" and spec in ("arithmetic", "math"):
        return (
            f"answer {answer!r} is one countdown expression of many: only the countdown reward checks a "
            "response against the row's numbers and target (use --reward.fn countdown)"
        )
    if spec == "countdown" and not ("numbers" in meta and "target" in meta):
        return "the countdown reward needs the row's numbers and target (--data.source countdown gives them)"
    if spec == "arithmetic" and parse_int(str(answer)) is None:
        return (
            f"answer {answer!r} is not an integer: the arithmetic reward scores integer answers only "
            f"(use --reward.fn math)"
        )
    if spec == "math":
        from math_verify import parse

        if not parse(str(answer)) and not parse(f"${answer}$"):
            return f"math-verify cannot parse the answer {answer!r}"
    return None


def resolve_reward_fn(spec: str) -> RewardFn:
    """A registered name or 'module:function'; RewardError naming the problem and the fix otherwise.

    An import path must name a plain Python function defined in a module of the user's, never a
    builtin or a standard-library function: ``builtins:exec``, ``builtins:eval``, ``os:system`` or
    ``subprocess:run`` would run every completion the policy writes as code or as a command."""
    fn = REWARDS.resolve(spec)
    problem = _not_a_user_function(fn)
    if problem:
        raise RewardError(
            f"--reward.fn={spec!r} is {problem}: a reward function must be a plain Python function defined "
            f"in your own module (def fn(completion, answer, meta) -> float), not a builtin"
        )
    return fn


def _not_a_user_function(fn) -> str:
    """Why ``fn`` is not a user's Python function ("" if it is)."""
    import inspect
    import sys

    target = inspect.unwrap(getattr(fn, "func", fn))  # functools.partial / wraps: judge what is called
    if inspect.isbuiltin(target) or type(target).__name__ in (
        "method-wrapper",
        "wrapper_descriptor",
        "method_descriptor",
    ):
        return f"the builtin {getattr(target, '__name__', type(target).__name__)}"
    module = getattr(target, "__module__", None) or type(target).__module__
    top = str(module).split(".")[0]
    if top in ("builtins", "__builtin__") or top in getattr(sys, "stdlib_module_names", ()):
        return f"{getattr(target, '__name__', 'a function')} from the standard library ({module})"
    return ""


MAX_ABS_REWARD = 1e6
"""A reward beyond this magnitude is a bug in the reward function (it overflows the advantages)."""


def score(fn: RewardFn, completion: str, answer: str, meta: dict, format_weight: float = 0.0) -> tuple[float, dict]:
    """(answer_reward + format_weight * format_reward, info). Never raises: errors give reward 0 and info['error'].

    info: answer_reward, format_reward (1 only for a correct boxed answer), boxed (1 if the
    completion has a non-empty box, right or wrong: the rate the policy boxes at), error, elapsed_s,
    and reason when the function raised NoCredit (a zero with its cause, e.g. "sandbox: timeout").
    """
    t0 = time.perf_counter()
    info: dict = {
        "error": None,
        "answer_reward": 0.0,
        "format_reward": 0.0,
        "boxed": 1.0 if last_boxed(completion) is not None else 0.0,
    }
    try:
        value = fn(completion, answer, meta)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"reward function returned {value!r}; it must return a finite float")
        if abs(value) > MAX_ABS_REWARD:
            raise ValueError(
                f"reward function returned {value!r}, beyond +-{MAX_ABS_REWARD:g}: advantages of rewards "
                f"that large overflow; scale the reward down"
            )
    except NoCredit as e:
        info["reason"] = str(e)
        return 0.0, _done(info, t0)
    except Exception as e:  # a user function may raise anything; the run must go on
        info["error"] = f"{type(e).__name__}: {e}"
        return 0.0, _done(info, t0)
    info["answer_reward"] = float(value)
    info["format_reward"] = format_reward(completion, info["answer_reward"])
    return info["answer_reward"] + format_weight * info["format_reward"], _done(info, t0)


def _done(info: dict, t0: float) -> dict:
    info["elapsed_s"] = time.perf_counter() - t0
    return info
