"""Recipes: an RL algorithm's flags as its paper gives them, put over a machine preset.

    cfg = RECIPES["dapo"].apply(preset_gpu_7b())     # what --preset gpu-7b+dapo builds

Each recipe names its source and sets only algorithm flags (advantage, loss, clipping, loss
aggregation, KL, dynamic sampling, overlong shaping); the model, ranks, lengths, data and reward
stay the machine preset's. Lengths that a paper gives in tokens for its own response cap are
scaled to the preset's --rollout.max-new-tokens. docs/recipes.md lists every flag with its source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    name: str
    source: str
    """Paper (authors, year, arXiv id) the flags come from."""
    train: Callable
    """cfg -> {TrainConfig field: value}: the flags the recipe sets."""

    def apply(self, cfg):
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **self.train(cfg)))

    def flags(self, cfg) -> dict[str, object]:
        """{'--train.flag': value} this recipe sets over cfg (docs/recipes.md; tests compare)."""
        return {f"--train.{k.replace('_', '-')}": v for k, v in self.train(cfg).items()}


def _dapo(cfg) -> dict:
    cap = cfg.rollout.max_new_tokens
    return {
        "advantage": "grpo",  # group-relative advantage: (r - mean) / std over the group
        "loss": "grpo",  # PPO-clip per token ...
        "clip_low": 0.2,  # ... with the decoupled range of clip-higher: eps_low 0.2,
        "clip_high": 0.28,  # eps_high 0.28 (DAPO section 3.1)
        "loss_agg": "token-mean",  # token-level policy-gradient loss (section 3.3)
        "dynamic_sampling": True,  # drop all-equal groups (section 3.2) ...
        "dynamic_sampling_refill": 2 * cfg.staleness.batch_size,  # ... and refill the batch with new prompts
        "overlong_max_tokens": cap,  # soft overlong punishment up to L_max = the response cap (section 3.4)
        "overlong_cache_tokens": max(1, cap // 5),  # L_cache = 4096 of L_max = 20480 in the paper: 1/5
        "kl_coef": 0.0,  # no KL term (section 2.3)
    }


def _grpo(cfg) -> dict:
    return {
        "advantage": "grpo",  # (r - mean) / std within the group (DeepSeekMath section 4.1.2)
        "loss": "grpo",  # PPO-clip per token, eps 0.2
        "clip_low": 0.2,
        "clip_high": 0.2,
        "loss_agg": "seq-mean",  # 1/G sum_i 1/|o_i| sum_t (eq. 3)
        "kl_coef": 0.04,  # beta = 0.04 (section 4.2) ...
        "kl_estimator": "k3",  # ... with the unbiased k3 estimator (eq. 4)
        "dynamic_sampling": False,
        "dynamic_sampling_refill": 0,
        "overlong_max_tokens": 0,
        "overlong_cache_tokens": 0,
    }


def _dr_grpo(cfg) -> dict:
    return {
        "advantage": "dr-grpo",  # r - mean, no division by the group's std (section 3.2)
        "loss": "grpo",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "loss_agg": "seq-mean-token-sum-norm",  # no 1/|o_i|: a constant (the max length) normalises
        "kl_coef": 0.0,  # no KL term (the paper's Oat runs use beta = 0)
        "dynamic_sampling": False,
        "dynamic_sampling_refill": 0,
        "overlong_max_tokens": 0,
        "overlong_cache_tokens": 0,
    }


def _gspo(cfg) -> dict:
    return {
        "advantage": "grpo",  # group-relative advantage as GRPO
        "loss": "gspo",  # length-normalised sequence ratio, clipped per sequence (eq. 5-7)
        "clip_low": 3e-4,  # the paper's clipping range: left 3e-4,
        "clip_high": 4e-4,  # right 4e-4 (section 5.1)
        "loss_agg": "seq-mean",  # 1/G sum_i over sequences
        "kl_coef": 0.0,
        "dynamic_sampling": False,
        "dynamic_sampling_refill": 0,
        "overlong_max_tokens": 0,
        "overlong_cache_tokens": 0,
    }


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "dapo",
            "Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale, arXiv 2503.14476",
            _dapo,
        ),
        Recipe("grpo", "Shao et al. 2024, DeepSeekMath (GRPO), arXiv 2402.03300", _grpo),
        Recipe(
            "dr-grpo",
            "Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective, arXiv 2503.20783",
            _dr_grpo,
        ),
        Recipe("gspo", "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv 2507.18071", _gspo),
    )
}
