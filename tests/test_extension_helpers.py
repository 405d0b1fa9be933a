"""Objects for tests/test_extensions.py, loaded by import path 'test_extension_helpers:NAME': one
that fits each extension kind (and does something a built-in never does, so a test can tell it
ran) and some of the wrong shape.

Not a test module (it defines no tests); it lives in tests/ so that pytest puts it on sys.path.
"""

from __future__ import annotations

from staleflow.train.losses import Correction, tis_token

NOT_CALLABLE = 7


def two_args(a, b):
    """Fits no kind: a loss takes 3 arguments, an advantage estimator 1, a task 2 (but returns None)."""
    return None


class NoChoose:
    """A class of the right constructor with neither choose() nor should_pull()."""

    def __init__(self, cfg, cost_model):
        pass


class PullWithoutFlags:
    """should_pull without the blocks_routing / blocks_trainer attributes the coordinator reads."""

    def __init__(self, cfg, cost_model):
        pass

    def should_pull(self, inst, ctx) -> bool:
        return True


class NeverPull:
    """A pull policy under which no instance ever loads a new version (every built-in pulls sometime)."""

    blocks_routing = False
    blocks_trainer = False

    def __init__(self, cfg, cost_model):
        pass

    def should_pull(self, inst, ctx) -> bool:
        return False


class LastInstance:
    """Routes to the candidate with the highest instance id."""

    def __init__(self, cfg, cost_model):
        pass

    def choose(self, traj, traj_version, candidates, ctx):
        return max(candidates, key=lambda i: i.instance) if candidates else None


def half_tis(s, x) -> Correction:
    """tis-token with every weight halved: the loss is exactly half of tis-token's."""
    c = tis_token(s, x)
    return Correction(c.logp_old, 0.5 * c.weight, c.truncated, c.rejected)


def always_recompute(s, x) -> Correction:
    return tis_token(s, x)


always_recompute.recompute_proximal = True


def bad_flag(s, x) -> Correction:
    return tis_token(s, x)


bad_flag.recompute_proximal = "yes"


def reinforce(s, x, logp_old):
    """Plain REINFORCE: -A * logp per token, nothing clipped."""
    import torch

    return -x.advantages * x.logp, torch.zeros_like(x.logp, dtype=torch.bool)


def per_sequence_loss(s, x, logp_old):
    """Wrong output: one value per sequence instead of one per token."""
    import torch

    return torch.zeros(x.num_seqs), torch.zeros(x.num_seqs, dtype=torch.bool)


def sign_advantage(rewards: list[float]) -> list[float]:
    """+1 above the group mean, -1 below, 0 at it."""
    m = sum(rewards) / len(rewards)
    return [float((r > m) - (r < m)) for r in rewards]


def no_advantage(rewards: list[float]) -> list[float]:
    """Wrong output: nothing for a group of any size."""
    return []


def squares(seed: int, index: int) -> tuple[str, str, dict]:
    """Row k asks for k squared."""
    return f"What is {index} squared? Put the final answer in \\boxed{{}}.", str(index * index), {"k": index}


def empty_prompt(seed: int, index: int) -> tuple[str, str, dict]:
    return "", "1", {}
