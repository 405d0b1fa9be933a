"""Run presets (``--preset NAME``): plain functions returning a RunConfig, registered in PRESETS.

    smollm2-cpu   the embedded default: SmolLM2-135M-Instruct, arithmetic, 1 trainer + 2 rollout on CPU
    tiny          a tiny random Llama for tests and quick checks (seconds per step on CPU)
"""

from __future__ import annotations

from typing import Callable

from staleflow.config import ModelConfig, RewardConfig, RolloutConfig, RunConfig, StalenessConfig, TrainConfig


def preset_smollm2_cpu() -> RunConfig:
    """The embedded default: SmolLM2-135M-Instruct on the built-in arithmetic task, CPU, 1 trainer + 2 rollout.

    Sized to finish in minutes on 2 CPU cores: 4 prompts x 4 responses per step, responses up to
    128 tokens, eta 1. The reward is the answer check plus 0.5 when the right answer is in \\boxed{}.
    """
    return RunConfig(
        rollout=RolloutConfig(max_new_tokens=128, max_model_len=512, max_kv_tokens=32768),
        train=TrainConfig(lr=2e-5, micro_batch_tokens=2048),
        staleness=StalenessConfig(eta=1, batch_size=4, group_size=4),
        reward=RewardConfig(fn="arithmetic", format_weight=0.5),
        steps=20,
    )


def preset_tiny() -> RunConfig:
    """A tiny random Llama for tests and quick checks (seconds per step on CPU)."""
    return RunConfig(
        model=ModelConfig(path="tiny-llama"),
        rollout=RolloutConfig(max_new_tokens=16, max_model_len=256, max_kv_tokens=8192),
        train=TrainConfig(lr=1e-3, micro_batch_tokens=1024),
        staleness=StalenessConfig(eta=1, batch_size=4, group_size=4),
        steps=4,
    )


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "smollm2-cpu": preset_smollm2_cpu,
    "tiny": preset_tiny,
}
