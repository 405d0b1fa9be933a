"""The token payload of one trajectory (``TrajectoryTokens``): prompt and response tokens, behaviour
log-probs, per-token weight versions and a loss mask, the same object from the engine's output through
the rollout rank's ring to the trainer (``staleflow/trajectory.py`` lists the forms of the path
around it and re-exports these names).

A module of its own, plain Python (no torch, no msgspec), so that the engine (rollout/) imports it
without the control plane's packages: the device check runs the engine on a GPU image that lacks them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

ENV_LOGPROB = 0.0
"""Behaviour log-prob stored for an environment token (loss_mask 0): no policy sampled it."""
ENV_VERSION = -1
"""Weight version stored for an environment token (loss_mask 0); a model token's is >= 0."""


def _values(x) -> list:
    """A field's values as a new Python list (tensors via tolist, without importing torch)."""
    return x.tolist() if hasattr(x, "tolist") else list(x)


@dataclass
class TrajectoryTokens:
    """The token payload of one trajectory, the same object from the engine's output to the trainer:
    the engine's Request holds it (rollout/engine.py: what a rank adds and what the engine returns; its
    running Sequence references that Request), the ring stores it
    (servers/trajectory.py), the trainer takes it beside its TrainGroup (which holds the reward and
    V_traj: ``Trainer.step(groups, payloads)``).

    ``response_ids`` is every token after the prompt: sampled by the model (``loss_mask`` 1: trained,
    with its behaviour log-prob and the weight version that sampled it) or added by an environment
    (an observation, ``loss_mask`` 0: context only, stored with ENV_LOGPROB and ENV_VERSION).
    ``loss_mask`` None means all ones (a single-turn trajectory: every response token is the model's).
    Fields hold lists (engines) or 1-D tensors (read back from a ring).

    >>> t = TrajectoryTokens([1, 2], [5, 6, 7], [-0.1, ENV_LOGPROB, -0.3], [4, ENV_VERSION, 5], [1, 0, 1])
    >>> t.validate(); t.seq_len, t.num_trained
    (5, 2)
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int] = field(default_factory=list)
    behaviour_logprobs: Sequence[float] = field(default_factory=list)
    """Log-prob of each response token under the computation that sampled it: after a Pull that kept
    the KV, the new weights over K/V the old ones computed (docs/engine.md)."""
    versions: Sequence[int] = field(default_factory=list)
    """Weight version that sampled each response token (differs within a trajectory after a Pull)."""
    loss_mask: Sequence[int] | None = None
    """1 per model token, 0 per environment token; None: all ones."""

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_trained(self) -> int:
        """Response tokens the loss trains on (the model's)."""
        return len(self.response_ids) if self.loss_mask is None else int(sum(_values(self.loss_mask)))

    def mask_values(self) -> list[int]:
        """The loss mask as a list (ones for None)."""
        return [1] * len(self.response_ids) if self.loss_mask is None else [int(m) for m in _values(self.loss_mask)]

    def append(self, token: int, logprob: float, version: int) -> None:
        """A token sampled by the model (list fields only)."""
        self.response_ids.append(token)
        self.behaviour_logprobs.append(logprob)
        self.versions.append(version)
        if self.loss_mask is not None:
            self.loss_mask.append(1)

    def append_observation(self, token_ids: Sequence[int]) -> None:
        """Environment tokens (a tool's output): context for the model, excluded from the loss."""
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        n = len(token_ids)
        self.response_ids.extend(int(t) for t in token_ids)
        self.behaviour_logprobs.extend([ENV_LOGPROB] * n)
        self.versions.extend([ENV_VERSION] * n)
        self.loss_mask.extend([0] * n)

    def copy(self) -> TrajectoryTokens:
        """A copy with list fields (what an engine keeps and extends; tensors become Python lists)."""
        return TrajectoryTokens(
            _values(self.prompt_ids),
            _values(self.response_ids),
            _values(self.behaviour_logprobs),
            _values(self.versions),
            None if self.loss_mask is None else _values(self.loss_mask),
        )

    def validate(self, what: str = "trajectory") -> None:
        """Raise ValueError, one line naming ``what`` and the inconsistent field."""
        n = len(self.response_ids)
        if len(self.prompt_ids) < 1:
            raise ValueError(f"{what}: prompt_ids is empty; a trajectory needs at least one prompt token")
        if len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"{what}: {len(self.behaviour_logprobs)} behaviour_logprobs for {n} response tokens: "
                "the rollout must return one log-prob per generated token"
            )
        if len(self.versions) != n:
            raise ValueError(f"{what}: {len(self.versions)} versions for {n} response tokens: need one per token")
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(
                f"{what}: {len(self.loss_mask)} loss_mask entries for {n} response tokens: need one per token"
            )
        mask = self.mask_values()
        for j, (lp, v, m) in enumerate(zip(_values(self.behaviour_logprobs), _values(self.versions), mask)):
            if m == 1:
                if not (lp <= 1e-3 and math.isfinite(lp)):  # engines may round log(1) a hair above 0
                    raise ValueError(
                        f"{what}: behaviour log-prob {lp!r} is invalid: must be finite and <= 0 (log of a probability)"
                    )
                if v < 0:
                    raise ValueError(f"{what}: versions[{j}]={v} is invalid for a model token: must be >= 0")
            elif m == 0:
                if lp != ENV_LOGPROB or v != ENV_VERSION:
                    raise ValueError(
                        f"{what}: environment token {j} (loss_mask 0) has behaviour log-prob {lp!r} and version "
                        f"{v}: store ENV_LOGPROB={ENV_LOGPROB} and ENV_VERSION={ENV_VERSION} (no policy sampled it)"
                    )
            else:
                raise ValueError(f"{what}: loss_mask[{j}]={m!r} is invalid: must be 1 (model token) or 0 (environment)")


def model_versions(tokens: TrajectoryTokens) -> list[int]:
    """The weight versions of a payload's model tokens, in order (environment tokens have none)."""
    versions = [int(v) for v in _values(tokens.versions)]
    return versions if tokens.loss_mask is None else [v for v, m in zip(versions, tokens.mask_values()) if m]
