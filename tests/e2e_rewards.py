"""Reward functions for end-to-end tests with tiny random models (passed as --reward.fn e2e_rewards:NAME).

A random model never solves arithmetic, so these rewards score something it can learn in a
few steps and that varies within a group from the start.
"""


def text_length(completion: str, answer: str, meta: dict) -> float:
    """Decoded length in characters / 400, capped at 1: rewards tokens that decode to long strings."""
    return min(1.0, len(completion.strip()) / 400.0)


def raises(completion: str, answer: str, meta: dict) -> float:
    """A broken reward function: the run must stop after --reward.max-consecutive-failures calls."""
    raise ZeroDivisionError("reward bug")


def flaky(completion: str, answer: str, meta: dict) -> float:
    """Fails on completions of an odd number of characters: failures are counted, the run goes on."""
    if len(completion) % 2:
        return float("nan")
    return text_length(completion, answer, meta)
