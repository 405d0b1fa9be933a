"""staleflow.reward: reward functions by name or import path, and the asynchronous RewardPool.

    from staleflow.reward import RewardPool, resolve_reward_fn, score

    fn = resolve_reward_fn("math")            # arithmetic | math | countdown | code_tests | "pkg.mod:function"
    reward, info = score(fn, completion, answer, meta, format_weight=0.1)

    pool = RewardPool(cfg.reward)             # worker processes (spawn); bad fn fails here
    pool.submit(key, completion, answer, meta)
    for key, reward, info in pool.poll(): ...

A reward function is ``fn(completion_text: str, answer: str, meta: dict) -> float``; ``score``
adds ``format_weight`` only to a correct answer (>= FULL_CREDIT) given in a \\boxed{}. See
docs/data-and-rewards.md.
"""

from staleflow.reward.code_tests import code_tests_reward, last_python_block
from staleflow.reward.countdown import check_countdown, completion_expression, last_plain_expression
from staleflow.reward.extract import all_boxed, final_number, last_boxed, parse_int
from staleflow.reward.functions import (
    FULL_CREDIT,
    REWARDS,
    NoCredit,
    RewardError,
    RewardFn,
    arithmetic_reward,
    countdown_reward,
    format_reward,
    math_reward,
    register_reward,
    resolve_reward_fn,
    score,
)
from staleflow.reward.pool import RewardPool

__all__ = [
    "FULL_CREDIT",
    "NoCredit",
    "REWARDS",
    "RewardError",
    "RewardFn",
    "RewardPool",
    "all_boxed",
    "arithmetic_reward",
    "check_countdown",
    "code_tests_reward",
    "completion_expression",
    "countdown_reward",
    "final_number",
    "format_reward",
    "last_boxed",
    "last_plain_expression",
    "last_python_block",
    "math_reward",
    "parse_int",
    "register_reward",
    "resolve_reward_fn",
    "score",
]
