"""Advantage estimators for group-based RL (GRPO family), plus DAPO's data-side tricks.

Pure Python on plain lists (no torch): the trainer calls

    adv = compute_advantages("grpo", rewards, group_ids)

to get one scalar advantage per trajectory; every response token of a trajectory shares it.
Estimators, by registered name (``--train.advantage``):

- grpo:       (r - mean_g) / (std_g + eps), std unbiased (n - 1) over the group;
- grpo-nostd: r - mean_g (no std normalisation: no bias towards easy/hard prompts);
- dr-grpo:    r - mean_g (the same numbers as grpo-nostd). Dr. GRPO's other half, a loss
              divided by a constant (S * max response length) instead of by lengths, is a loss
              aggregation matter: ``--train.loss-agg auto`` picks ``seq-mean-token-sum-norm`` for
              dr-grpo, and any other explicit choice warns (losses.resolve_loss_agg);
- rloo:       r - mean of the OTHER members = n / (n - 1) * (r - mean_g).

Each is a registered function ``fn(rewards of one group) -> advantages of that group`` (one per
reward, same order); ``--train.advantage`` also takes 'package.module:name' (docs/extending.md).
A group of one member, or with all rewards equal, gets advantage 0 everywhere.
DAPO's dynamic sampling (`groups_with_signal`) drops such all-equal groups before training,
and overlong reward shaping (`overlong_penalty`) penalises responses running into the length cap.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence

from staleflow.extensions import Registry, Shape

GROUP_EPS = 1e-6

AdvantageFn = Callable[[list[float]], list[float]]
"""fn(rewards of one group, as floats) -> one advantage per reward, same order."""
ADVANTAGES: Registry[AdvantageFn] = Registry(
    "advantage estimator", "--train.advantage", Shape.function(1, "fn(rewards of one group) -> advantages (one each)")
)
register_advantage = ADVANTAGES.register
"""Decorator: register fn(rewards of one group) -> advantages of that group under `name`."""


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


@register_advantage("grpo")
def grpo(rewards: list[float]) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    m = _mean(rewards)
    std = math.sqrt(math.fsum((r - m) ** 2 for r in rewards) / (n - 1))
    return [(r - m) / (std + GROUP_EPS) for r in rewards]


@register_advantage("grpo-nostd")
def grpo_nostd(rewards: list[float]) -> list[float]:
    m = _mean(rewards)
    return [r - m for r in rewards]


@register_advantage("dr-grpo")
def dr_grpo(rewards: list[float]) -> list[float]:
    return grpo_nostd(rewards)


@register_advantage("rloo")
def rloo(rewards: list[float]) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = math.fsum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def _groups(group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    return groups


def compute_advantages(
    name: str, rewards: Sequence[float], group_ids: Sequence[Hashable], fn: AdvantageFn | None = None
) -> list[float]:
    """One advantage per trajectory, computed within each group of equal group_id by the estimator
    `name` (a registered name or an import path; ``fn``: the function it already resolved to)."""
    fn = ADVANTAGES.resolve(name) if fn is None else fn
    if len(rewards) != len(group_ids):
        raise ValueError(f"got {len(rewards)} rewards but {len(group_ids)} group ids: one of each per trajectory")
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"reward of trajectory {i} is {r!r}: rewards must be finite numbers")
    out = [0.0] * len(rewards)
    for members in _groups(group_ids).values():
        adv = fn([float(rewards[i]) for i in members])
        if len(adv) != len(members) or not all(isinstance(a, numbers.Real) and math.isfinite(a) for a in adv):
            raise ValueError(
                f"--train.advantage={name!r} returned {adv!r} for a group of {len(members)} rewards; "
                f"it must return one finite number per reward"
            )
        for i, a in zip(members, adv):
            out[i] = float(a)
    return out


def groups_with_signal(rewards: Sequence[float], group_ids: Sequence[Hashable]) -> list[bool]:
    """DAPO dynamic sampling: keep[i] is False when trajectory i's group has all rewards equal."""
    keep = [True] * len(rewards)
    for members in _groups(group_ids).values():
        if len({float(rewards[i]) for i in members}) == 1:
            for i in members:
                keep[i] = False
    return keep


def overlong_penalty(response_len: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO soft overlong punishment added to the reward.

    0 up to max_tokens - cache_tokens, then a linear ramp down to -1 at max_tokens, -1 beyond.
    max_tokens = 0 disables it.
    """
    if max_tokens <= 0:
        return 0.0
    if not 0 <= cache_tokens <= max_tokens:
        raise ValueError(
            f"overlong cache_tokens={cache_tokens!r} is invalid: need 0 <= cache <= max_tokens={max_tokens}"
        )
    free = max_tokens - cache_tokens
    if response_len <= free:
        return 0.0
    if response_len <= max_tokens and cache_tokens > 0:
        return (free - response_len) / cache_tokens
    return -1.0
