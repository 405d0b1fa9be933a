"""The LoRA section of a run (``--lora.rank 8 --lora.target-modules q_proj,v_proj``): low-rank
adapters trained instead of the whole policy (train/lora.py, docs/lora.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from staleflow.config.sections import _check

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter can be put on (dense ones: a mixture-of-experts layer's experts are not adapted)."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA: W x + (alpha / rank) B A dropout(x) on the target projections; only A and B are trained."""

    rank: int = 0
    """Rank r of every adapter (0: no LoRA, the whole policy is trained)."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) B A (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (PEFT's lora_dropout)."""
    target_modules: str = "q_proj,k_proj,v_proj,o_proj"
    """Projections that get an adapter in every layer, comma-separated, among q_proj k_proj v_proj o_proj
    gate_proj up_proj down_proj (all-linear: every one of them)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def targets(self) -> tuple[str, ...]:
        """The target projection names (``target_modules`` parsed)."""
        if self.target_modules.strip() == "all-linear":
            return LORA_TARGETS
        return tuple(t for t in self.target_modules.replace(" ", ",").split(",") if t)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def __post_init__(self):
        _check(0 <= self.rank <= 4096, "lora.rank", self.rank, "must be in [0, 4096] (0: no LoRA)")
        _check(math.isfinite(self.alpha) and self.alpha > 0, "lora.alpha", self.alpha, "must be > 0")
        _check(0 <= self.dropout < 1, "lora.dropout", self.dropout, "must be in [0, 1)")
        targets = self.targets
        _check(
            bool(targets) and all(t in LORA_TARGETS for t in targets) and len(set(targets)) == len(targets),
            "lora.target-modules",
            self.target_modules,
            f"name each projection once, comma-separated, among {','.join(LORA_TARGETS)} (or all-linear)",
        )
