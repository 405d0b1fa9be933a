"""Scoring answers and summarising an evaluation: shared by ``staleflow eval`` and the main job's
held-out evaluation (runtime/evaluation.py), so both count "correct" and state intervals alike.

    ok, info = is_correct(fn, "... \\boxed{12}", "12", {})     # answer reward >= 1 (format bonus ignored)
    summarize([[True], [False], [True]])                    # greedy: Wilson interval
    summarize([[True, False, False], [False, False, True]]) # K samples per prompt: bootstrap, pass@K
"""

from __future__ import annotations

from statistics import fmean

from staleflow.metrics.stats import LEVEL, bootstrap_mean, pass_at_k, wilson
from staleflow.reward.functions import FULL_CREDIT, RewardFn, score


def is_correct(fn: RewardFn, text: str, answer: str, meta: dict) -> tuple[bool, dict]:
    """(answer reward >= full credit, score's info). A reward function that raises is a wrong
    answer with info['error'] set (the caller counts those)."""
    _, info = score(fn, text, answer, dict(meta))
    return info["answer_reward"] >= FULL_CREDIT, info


def summarize(correct: list[list[bool]]) -> dict:
    """Accuracy and its 95% interval over prompts, each with K >= 1 answers (the same K for all).

    K = 1: accuracy = fraction correct, Wilson interval. K > 1: accuracy = mean over prompts of the
    fraction of its K samples that are correct, percentile bootstrap over prompts (a prompt's
    samples are correlated), and pass_at_k = the fraction of prompts with at least one correct
    sample (the unbiased estimator at k = K)."""
    if not correct:
        raise ValueError("nothing to summarize: no prompts were evaluated")
    k = len(correct[0])
    if k < 1 or any(len(c) != k for c in correct):
        raise ValueError("every prompt needs the same number (>= 1) of answers")
    n = len(correct)
    if k == 1:
        right = sum(bool(c[0]) for c in correct)
        lo, hi = wilson(right, n, LEVEL)
        return {"accuracy": right / n, "ci95_low": lo, "ci95_high": hi, "ci_method": "wilson", "n": n}
    per_prompt = [sum(map(bool, c)) / k for c in correct]
    lo, hi = bootstrap_mean(per_prompt, LEVEL)
    return {
        "accuracy": fmean(per_prompt),
        "ci95_low": lo,
        "ci95_high": hi,
        "ci_method": "bootstrap over prompts",
        "n": n,
        "samples": k,
        "pass_at_k": fmean(pass_at_k(k, sum(map(bool, c)), k) for c in correct),
    }


def interval_text(acc: float, lo: float, hi: float) -> str:
    """'0.453 (95% CI 0.368-0.541)': how an accuracy is printed everywhere."""
    return f"{acc:.3f} (95% CI {lo:.3f}-{hi:.3f})"
