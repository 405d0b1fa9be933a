"""Speculative decoding of the built-in rollout engine (``--rollout.speculative.draft-tokens 4``): drafts
from a suffix match over the GRPO group's own tokens, verified in one forward with exact rejection
sampling (rollout/speculative.py, docs/engine.md "Speculative decoding"). A section of RolloutConfig."""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.config.ranges import in_range
from staleflow.faults import ConfigError


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding from group siblings (built-in engine; the sampled distribution is unchanged)."""

    draft_tokens: int = 0
    """Most draft tokens a decoding sequence proposes per step (0: off). Measured on the 2-core CPU
    machine in docs/perf.md (2026-12-07): SmolLM2 at T=1 accepts 23-38 % of the drafts, 1.04-1.16
    tokens per forward, which does not pay back the verification forward on that CPU."""
    min_match: int = 2
    """Shortest suffix of a sequence's context that must recur in its group to propose a draft."""
    max_match: int = 8
    """Longest suffix matched (the longest match found wins)."""
    siblings: bool = True
    """Match the group's other responses too (requests with the same prompt ids); off: own context only."""
    adaptive: bool = True
    """Per-sequence draft length: cut to 1 + the tokens accepted at a rejection, +1 after a full acceptance."""
    max_batch: int = 4
    """No drafts in a step with more decoding sequences than this (verification then costs more
    than it saves on a compute-bound CPU); tail lanes and stragglers decode at batch 1-4."""

    @property
    def enabled(self) -> bool:
        return self.draft_tokens > 0

    def __post_init__(self):
        in_range(self, "rollout.speculative")  # every integer within +-2**40 (config/ranges.py)
        # sections.py composes this section, so its _check cannot be imported here: the same one-line form
        for ok, flag, value, need in (
            (0 <= self.draft_tokens <= 64, "draft-tokens", self.draft_tokens, "must be in [0, 64] (0: off)"),
            (self.min_match >= 1, "min-match", self.min_match, "must be >= 1"),
            (
                self.max_match >= self.min_match,
                "max-match",
                self.max_match,
                f"must be >= --rollout.speculative.min-match ({self.min_match})",
            ),
            (self.max_batch >= 1, "max-batch", self.max_batch, "must be >= 1"),
        ):
            if not ok:
                raise ConfigError(f"--rollout.speculative.{flag}={value!r} is invalid: {need}")
