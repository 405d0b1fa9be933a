"""User reward functions for tests/test_reward.py, loaded by import path 'test_reward_helpers:NAME'.

Not a test module (it defines no tests); it lives in tests/ so that pytest puts it on sys.path,
which spawned reward workers inherit.
"""

import os
import time

NOT_CALLABLE = 42


def length_match(completion: str, answer: str, meta: dict) -> float:
    """1.0 when the completion is exactly as long as the answer, else 0.25."""
    return 1.0 if len(completion) == len(answer) else 0.25


def misbehaving(completion: str, answer: str, meta: dict) -> float:
    """Does what meta['do'] says: raise, sleep, exit the process, return garbage, or score normally."""
    action = meta.get("do", "ok")
    if action == "raise":
        raise RuntimeError(f"asked to fail on {completion!r}")
    if action == "sleep":
        time.sleep(60)
    if action == "exit":
        os._exit(3)
    if action == "nan":
        return float("nan")
    if action == "str":
        return "1.0"
    return 1.0 if completion == answer else 0.0
