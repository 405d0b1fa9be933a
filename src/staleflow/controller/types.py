"""The controller loop's plain data: its settings, what a workload supplies, the record of one
trained step, the loop's audit, and the errors the loop raises. No behaviour lives here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from staleflow.controller.backend import TrainDone
from staleflow.faults import BadInput, Stuck
from staleflow.trajectory import TrainGroup


class Workload(Protocol):
    """Where prompts and per-trajectory draws come from (a dataset, or a simulated distribution)."""

    def next_prompt(self) -> Any: ...

    def prompt_len(self, prompt: Any) -> int: ...

    def prompt_ids(self, prompt: Any) -> list[int]:
        """The prompt's tokens, as a Route carries them to an instance ([] in the simulator)."""

    def new_member(self) -> tuple[int, int]:
        """(sampling seed, target length; 0 = the model decides)."""

    def env_fields(self, prompt: Any) -> dict:
        """Route fields an environment's reset needs from the data row ({"answer": ..., "meta": ...} in a
        multi-turn run, {} otherwise and in the simulator)."""


@dataclass(frozen=True)
class LoopSettings:
    steps: int
    """Stop once this many versions are published (eta, B', N' are the protocol's: ``manager.spec``)."""
    tick_s: float
    stall_s: float = math.inf
    """No finish, reward or step for this long: the run is stalled (the loop stops and says so)."""
    max_reward_failures: int = 0
    """Stop the run after this many consecutive failed reward calls (0: never)."""
    refill_groups: int = 0
    """DAPO dynamic sampling with refill: up to this many rewarded groups whose rewards are all equal
    are aborted per trainer version instead of occupying a slot; fresh prompts take their place."""

    @classmethod
    def from_config(
        cls, coordinator, steps: int, stall_s: float = math.inf, max_reward_failures: int = 0
    ) -> LoopSettings:
        return cls(
            steps=steps, tick_s=coordinator.tick_ms / 1000.0, stall_s=stall_s, max_reward_failures=max_reward_failures
        )


@dataclass
class StepRecord:
    """One trained buffer, as the loop saw it (the step metrics are computed from it)."""

    version: int
    t_start: float
    groups: list[TrainGroup]
    staleness: list[int]
    t_done: float = 0.0
    t_published: float | None = None
    train: TrainDone | None = None
    samples: dict[int, str] = field(default_factory=dict)
    """group id -> one member's decoded response (runtime only: what trained.jsonl shows)."""
    prompts: dict[int, Any] = field(default_factory=dict)
    """group id -> its prompt (the workload's object: a data Prompt in the runtime)."""

    @property
    def rewards(self) -> list[float]:
        return [r for g in self.groups for r in g.rewards]

    @property
    def response_tokens(self) -> int:
        return sum(sum(g.n_tokens) for g in self.groups)


class LoopTimeout(RuntimeError):
    """ControllerLoop.run waited longer than its timeout for its condition."""


class Stalled(Stuck):
    """The loop made no progress for its stall_s (a restart from the newest checkpoint: faults.py)."""


class RewardsFailing(BadInput, RuntimeError):
    """Too many consecutive reward calls failed: the reward function is broken, not unlucky (fatal:
    a restart would fail the same way, faults.py)."""
