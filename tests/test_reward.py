"""Reward functions: answer extraction, math / arithmetic / countdown / format rewards, user
functions by import path, and the asynchronous RewardPool (exactly-once results, errors,
timeouts, dead workers)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config import ConfigError, RewardConfig
from staleflow.data.tasks import countdown_row
from staleflow.reward import (
    RewardError,
    RewardPool,
    all_boxed,
    arithmetic_reward,
    check_countdown,
    completion_expression,
    countdown_reward,
    format_reward,
    last_boxed,
    math_reward,
    parse_int,
    resolve_reward_fn,
    score,
)

# ---- extraction -----------------------------------------------------------------------------


def test_last_boxed_nested_multiple_and_unclosed():
    assert last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} then \\boxed{ 2 }") == "2"
    assert all_boxed("\\boxed{1} \\fbox{2} \\boxed{3}") == ["1", "2", "3"]
    assert last_boxed("\\boxed{7} and \\boxed{8") == "7"  # the unclosed box is not an answer
    assert last_boxed("\\boxed{7} and \\boxed{ }") == "7"  # nor is an empty one
    assert last_boxed("no box here") is None and last_boxed("\\boxed{}") is None


def test_parse_int():
    assert [parse_int(s) for s in ["85", " -3 ", "1,200", "85.0", "$85$", "85."]] == [85, -3, 1200, 85, 85, 85]
    assert [parse_int(s) for s in ["8.5", "x", "", "1/2"]] == [None] * 4


# ---- math -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("So the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("So the result is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
        ("The answer is \\boxed{0.4}.", "0.5", 0.0),
        ("Final answer: 12", "12", 1.0),  # no box: math-verify's final-answer extraction
        ("I do not know.", "0.5", 0.0),  # missing box and no answer at all
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("\\boxed{\\text{no idea}} so the final answer is 12", "12", 0.0),  # the box is the answer, not the 12
        ("\\boxed{12 broke}", "12", 0.0),
        ("\\boxed{} Final answer: 12", "12", 1.0),  # an empty box is no box: the fallback reads the 12
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer, {}) == expected


def test_math_reward_unparsable_reference_is_an_error_not_a_crash():
    reward, info = score(math_reward, "\\boxed{1}", "", {})
    assert reward == 0.0 and "reference answer" in info["error"]


def test_math_reward_works_off_the_main_thread():
    # math-verify's signal.alarm timeouts only work in a main thread: we turn them off elsewhere.
    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(
            lambda: (
                threading.current_thread() is threading.main_thread(),
                score(math_reward, "\\boxed{\\frac{1}{2}}", "0.5", {}),
            )
        ).result()
    assert got[0] is False
    assert got[1][0] == 1.0 and got[1][1]["error"] is None


# ---- arithmetic -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("37 + 48 = 85, so \\boxed{85}", 1.0),
        ("\\boxed{84}", 0.0),
        ("\\boxed{85} ... wait, maybe 84", 1.0),  # the box wins over later numbers
        ("\\boxed{84} ... no, 85", 0.0),
        ("37 + 48 = 85", 1.0),  # no box: the final number
        ("I cannot compute that.", 0.0),
        ("\\boxed{1,0}", 0.0),
        ("37 + 48 = 85 \\boxed{85 apples}", 0.0),  # garbage in the box is the answer, and wrong
        ("\\boxed{37 + 48}", 0.0),
        ("\\boxed{} so 85", 1.0),  # an empty box is no box
    ],
)
def test_arithmetic_reward(completion, expected):
    assert arithmetic_reward(completion, "85", {}) == expected


@given(st.integers(-(10**6), 10**6), st.integers(-(10**6), 10**6))
def test_arithmetic_reward_is_exact_integer_match(said, gold):
    assert arithmetic_reward(f"so \\boxed{{{said}}}.", str(gold), {}) == float(said == gold)


# ---- countdown ------------------------------------------------------------------------------


def test_countdown_check_cases():
    nums = [4, 5, 25]
    assert check_countdown("(25 - 5) * 4", nums, 80) == (True, "ok")
    ok, why = check_countdown("(25 - 5) * 4 + 5", nums, 85)
    assert not ok and "exactly once" in why  # 5 used twice
    ok, why = check_countdown("25 * 4", nums, 100)
    assert not ok and "exactly once" in why  # 5 unused
    ok, why = check_countdown("(25 - 5) * 3", nums, 60)
    assert not ok and "exactly once" in why  # 3 is not given
    ok, why = check_countdown("4 / (5 - 5) + 25", [4, 5, 5, 25], 25)
    assert not ok and why == "division by zero"
    ok, why = check_countdown("25 * 4 - 5", nums, 80)
    assert not ok and "not the target" in why
    assert check_countdown("25 / 5 * 4", nums, 20)[0]  # exact rational arithmetic


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('false')",
        "25 ** 4",
        "-5 + 25 + 4",
        "x + 1",
        "(lambda: 1)()",
        "25.0 + 5 - 4",
        "[25, 5, 4]",
        "25 + 5 +",
    ],
)
def test_countdown_rejects_anything_but_integer_arithmetic(expr):
    ok, why = check_countdown(expr, [4, 5, 25], 26)
    assert not ok and why


def test_countdown_reward_reads_the_boxed_expression():
    meta = {"numbers": [4, 5, 25], "target": 80}
    assert countdown_reward("Try \\boxed{(25 - 5) \\times 4 = 80}", "", meta) == 1.0
    assert countdown_reward("<answer>(25-5)*4</answer>", "", meta) == 1.0
    assert countdown_reward("(25 - 5) * 4 = 80", "", meta) == 1.0  # no box, no tag: the last expression
    assert countdown_reward("(25 - 5) * 4 or maybe 25 * 4 - 5", "", meta) == 0.0  # the LAST one counts
    assert countdown_reward("\\boxed{80 yay} since (25 - 5) * 4 = 80", "", meta) == 0.0  # the box is the answer
    assert countdown_reward("\\boxed{25 * 4 - 5}", "", meta) == 0.0
    assert countdown_reward("\\boxed{4 / (5 - 5) * 25}", "", meta) == 0.0
    assert completion_expression("\\boxed{$3 \\div 1$}") == "3 / 1"
    reward, info = score(countdown_reward, "\\boxed{1+2}", "1+2", {})
    assert reward == 0.0 and "meta['numbers']" in info["error"]


@settings(max_examples=50)
@given(st.integers(0, 10**6), st.integers(0, 10**9))
def test_generated_countdown_answers_are_valid(seed, index):
    text, answer, meta = countdown_row(seed, index)
    assert check_countdown(answer, meta["numbers"], meta["target"]) == (True, "ok")
    assert countdown_reward(f"\\boxed{{{answer}}}", answer, meta) == 1.0
    assert str(meta["target"]) in text and str(meta["numbers"]) in text


# ---- format reward and score ----------------------------------------------------------------


def test_format_reward_and_weight():
    # The format bonus needs a correct answer in a box (it used to be paid for any non-empty box).
    assert format_reward("\\boxed{12}", 1.0) == 1.0
    assert format_reward("\\boxed{12}", 0.0) == 0.0 and format_reward("\\boxed{12}", 0.99) == 0.0
    assert format_reward("\\boxed{}", 1.0) == 0.0 and format_reward("12", 1.0) == 0.0
    fn = resolve_reward_fn("arithmetic")
    assert score(fn, "\\boxed{85}", "85", {}, format_weight=0.25)[0] == 1.25
    reward, info = score(fn, "\\boxed{84}", "85", {}, format_weight=0.25)
    assert reward == 0.0 and info["format_reward"] == 0.0 and info["boxed"] == 1.0  # was 0.25 before
    reward, info = score(fn, "85", "85", {}, format_weight=0.25)
    assert reward == 1.0 and info["format_reward"] == 0.0 and info["answer_reward"] == 1.0 and info["boxed"] == 0.0


@pytest.mark.parametrize(
    "do, error", [("raise", "RuntimeError: asked to fail"), ("nan", "finite float"), ("str", "finite float")]
)
def test_score_turns_bad_functions_into_zero_with_error(do, error):
    fn = resolve_reward_fn("test_reward_helpers:misbehaving")
    reward, info = score(fn, "a", "a", {"do": do}, format_weight=1.0)
    assert reward == 0.0 and error in info["error"]


# ---- user functions by import path ---------------------------------------------------------


def test_user_function_by_import_path():
    fn = resolve_reward_fn("test_reward_helpers:length_match")
    assert fn("abc", "xyz", {}) == 1.0 and fn("ab", "xyz", {}) == 0.25


@pytest.mark.parametrize(
    "spec, words",
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("test_reward_helpers:nope", "has no attribute 'nope'"),
        ("test_reward_helpers:NOT_CALLABLE", "not a callable"),
        ("mathh", "not a registered reward"),
        (":f", "must look like"),
    ],
)
def test_bad_reward_spec_is_a_clear_error(spec, words):
    with pytest.raises(RewardError, match=words):
        resolve_reward_fn(spec)
    with pytest.raises(RewardError, match=words):  # the pool fails at construction, before any worker
        RewardPool(RewardConfig(fn=spec))


def test_reward_config_validation():
    with pytest.raises(ConfigError, match="reward.timeout-s"):
        RewardConfig(timeout_s=0)


# ---- RewardPool -----------------------------------------------------------------------------


def _collect_all(pool, n, timeout=60.0):
    results = pool.drain(timeout)
    assert pool.pending() == 0, f"{pool.pending()} of {n} rewards still pending"
    return results


def test_pool_returns_every_key_once_and_survives_errors_timeouts_and_dead_workers():
    cfg = RewardConfig(fn="test_reward_helpers:misbehaving", workers=2, format_weight=0.5, timeout_s=3.0)
    with RewardPool(cfg) as pool:
        actions = ["ok", "raise", "ok", "sleep", "ok", "exit", "ok", "nan"] + ["ok"] * 8
        for i, do in enumerate(actions):
            answer = "\\boxed{x}"
            pool.submit(("traj", i), answer if i % 3 else "wrong", answer, {"do": do})
        assert isinstance(pool.poll(), list)  # non-blocking
        results = _collect_all(pool, len(actions))
        assert sorted(k for k, _, _ in results) == [("traj", i) for i in range(len(actions))]
        by_key = {k[1]: (r, info) for k, r, info in results}
        for i, do in enumerate(actions):
            reward, info = by_key[i]
            if do == "ok":
                assert info["error"] is None and reward == (1.5 if i % 3 else 0.0), (i, reward, info)
            else:
                assert reward == 0.0 and info["error"], (i, do, info)
        assert "timeout" in by_key[3][1]["error"] and "died" in by_key[5][1]["error"]
        assert pool.stats()["restarts"] == 2
        pool.submit("after", "\\boxed{x}", "\\boxed{x}", {})  # restarted workers still score
        assert [(k, r) for k, r, _ in _collect_all(pool, 1)] == [("after", 1.5)]


def test_pool_math_in_worker_processes_and_inline():
    cfg = RewardConfig(fn="math", workers=1)
    cases = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{0.4}", "0.5", 0.0), ("no idea", "0.5", 0.0)]
    for workers in (1, 0):
        with RewardPool(cfg, workers=workers) as pool:
            for i, (completion, answer, _) in enumerate(cases):
                pool.submit(i, completion, answer, {})
            got = {k: (r, info["error"]) for k, r, info in _collect_all(pool, len(cases))}
        assert got == {i: (expected, None) for i, (_, _, expected) in enumerate(cases)}


def test_pool_requeues_the_job_waiting_behind_a_killed_worker():
    # One worker, so each job after "sleep"/"exit" was already sitting in that worker's pipe.
    cfg = RewardConfig(fn="test_reward_helpers:misbehaving", workers=1, timeout_s=2.0)
    actions = ["ok", "sleep", "ok", "exit", "ok", "raise", "ok"]
    with RewardPool(cfg) as pool:
        for i, do in enumerate(actions):
            pool.submit(i, "a", "a", {"do": do})
        got = {k: (r, info["error"]) for k, r, info in _collect_all(pool, len(actions))}
        assert pool.stats()["timeouts"] == 1 and pool.stats()["restarts"] == 2
    assert sorted(got) == list(range(len(actions)))
    assert [got[i][0] for i in range(len(actions))] == [1.0 if do == "ok" else 0.0 for do in actions]
    assert "timeout" in got[1][1] and "died (exit code 3)" in got[3][1] and "RuntimeError" in got[5][1]
