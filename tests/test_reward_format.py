"""The format bonus cannot be won by format alone.

For every built-in reward that a format weight combines with (arithmetic, math, countdown), for the
default run configuration and for every format weight: a right answer without a box scores above a
wrong answer in a box, a right boxed answer scores at least as much as a right unboxed one, and a
box holding garbage earns no format credit even when the right answer is written next to it.
"""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from staleflow.data.tasks import arithmetic_row, countdown_row
from staleflow.presets import preset_smollm2_cpu
from staleflow.reward import resolve_reward_fn, score

WEIGHTS = st.floats(0.0, 100.0, allow_nan=False)


def _arithmetic_case(seed: int, index: int, delta: int) -> dict:
    _, answer, meta = arithmetic_row(seed, index)
    wrong = str(int(answer) + delta)
    return {
        "answer": answer,
        "meta": meta,
        "right_unboxed": f"Adding it up step by step, the result is {answer}.",
        "right_boxed": f"The result is \\boxed{{{answer}}}.",
        "wrong_boxed": f"\\boxed{{{wrong}}}",
        "garbage_boxed": [
            f"\\boxed{{{answer} broke}}",
            f"{answer}, so \\boxed{{{wrong} broke}}",
            f"It is {answer}. \\boxed{{\\text{{done}}}}",
        ],
    }


def _countdown_case(seed: int, index: int) -> dict:
    _, answer, meta = countdown_row(seed, index)
    target = meta["target"]
    return {
        "answer": answer,
        "meta": meta,
        "right_unboxed": f"Try {answer} = {target}",
        "right_boxed": f"\\boxed{{{answer} = {target}}}",
        "wrong_boxed": f"\\boxed{{{answer} + 1}}",  # one more number than given: always wrong
        "garbage_boxed": [f"{answer} = {target}, so \\boxed{{{target} yay}}", f"\\boxed{{{answer} is it}}"],
    }


def _check(fn_name: str, case: dict, weight: float) -> None:
    fn = resolve_reward_fn(fn_name)
    answer, meta = case["answer"], case["meta"]
    got = {k: score(fn, case[k], answer, meta, weight) for k in ("right_unboxed", "right_boxed", "wrong_boxed")}
    for k, (reward, info) in got.items():
        assert info["error"] is None, (k, info)
        assert reward == pytest.approx(info["answer_reward"] + weight * info["format_reward"]), (k, info)
    assert got["right_unboxed"][0] == 1.0 and got["right_unboxed"][1]["format_reward"] == 0.0
    assert got["wrong_boxed"][0] == 0.0 and got["wrong_boxed"][1]["boxed"] == 1.0
    assert got["right_unboxed"][0] > got["wrong_boxed"][0]
    assert got["right_boxed"][0] == pytest.approx(1.0 + weight)  # the bonus does reward the right box
    for text in case["garbage_boxed"]:
        reward, info = score(fn, text, answer, meta, weight)
        assert info["boxed"] == 1.0 and info["format_reward"] == 0.0 and reward == 0.0, (text, info)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**9), st.integers(-50, 50), WEIGHTS)
def test_arithmetic_format_bonus_needs_the_right_answer(seed, index, delta, weight):
    assume(delta != 0)
    _check("arithmetic", _arithmetic_case(seed, index, delta), weight)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**9), st.integers(1, 50), WEIGHTS)
def test_math_format_bonus_needs_the_right_answer(seed, index, delta, weight):
    case = _arithmetic_case(seed, index, delta)
    # math-verify reads "\boxed{0 broke}" as the product 0*b*r*o*k*e = 0: symbolically right
    assume(case["answer"] != "0")
    _check("math", case, weight)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**9), WEIGHTS)
def test_countdown_format_bonus_needs_the_right_answer(seed, index, weight):
    _check("countdown", _countdown_case(seed, index), weight)


@pytest.mark.parametrize("weight", [0.0, 0.1, 0.5, 1.0, 2.0, 10.0])
def test_math_symbolic_answers(weight):
    fn = resolve_reward_fn("math")
    right_unboxed = score(fn, "The final answer is $\\frac{1}{2}$.", "0.5", {}, weight)[0]
    wrong_boxed = score(fn, "\\boxed{\\frac{1}{3}}", "0.5", {}, weight)[0]
    right_boxed = score(fn, "\\boxed{\\frac{2}{4}}", "0.5", {}, weight)[0]
    assert right_unboxed == 1.0 and wrong_boxed == 0.0 and right_boxed == pytest.approx(1.0 + weight)


def test_default_recipe_no_longer_pays_for_the_box():
    """The samples the default recipe learned to emit (arithmetic, --reward.format-weight 0.5)."""
    cfg = preset_smollm2_cpu().reward
    fn = resolve_reward_fn(cfg.fn)
    assert cfg.fn == "arithmetic" and cfg.format_weight > 0
    wrong_boxed, info = score(fn, "\\boxed{115}", "21", {}, cfg.format_weight)  # "What is 50 - 29?"
    assert wrong_boxed == 0.0 and info["format_reward"] == 0.0
    garbage, info = score(fn, "\\boxed{66 broke}", "124", {}, cfg.format_weight)  # "58 + 66"
    assert garbage == 0.0 and info["format_reward"] == 0.0
    right_unboxed, _ = score(fn, "50 - 29 = 21", "21", {}, cfg.format_weight)
    right_boxed, _ = score(fn, "50 - 29 = \\boxed{21}", "21", {}, cfg.format_weight)
    assert right_boxed == 1.0 + cfg.format_weight > right_unboxed == 1.0 > wrong_boxed


@given(WEIGHTS)
def test_partial_credit_user_function_gets_no_bonus_below_full_credit(weight):
    fn = resolve_reward_fn("test_reward_helpers:length_match")  # 1.0 if the lengths match, else 0.25
    wrong_boxed, info = score(fn, "\\boxed{ab}", "xyz", {}, weight)
    assert wrong_boxed == 0.25 and info["format_reward"] == 0.0
    assert score(fn, "abc", "xyz", {}, weight)[0] == 1.0 > wrong_boxed
