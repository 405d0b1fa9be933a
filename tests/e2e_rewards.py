"""Reward functions for end-to-end tests with tiny random models (passed as --reward.fn e2e_rewards:NAME).

A random model never solves arithmetic, so these rewards score something it can learn in a
few steps and that varies within a group from the start.
"""


def text_length(completion: str, answer: str, meta: dict) -> float:
    """Decoded length in characters / 400, capped at 1: rewards tokens that decode to long strings."""
    return min(1.0, len(completion.strip()) / 400.0)
