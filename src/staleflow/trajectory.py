"""The forms a trajectory takes from prompt to loss: one class per step where the data changes.

    Prompt            a dataset row, tokenized                      data/source.py yields it
      -> TrajectoryItem   queued in the Trajectory Server (one per group member)   coordinator
      -> Route            sent to an instance, as is (V_traj fixed, prompt, seed)  coordinator -> loop -> rank
      -> Finished         generated: its tokens sit in a ring (RecordHandle)       rank -> loop
      -> TrainGroup       a consumed group: handles, rewards, V_traj               loop -> trainer ranks
      -> TrajectorySample read back from the ring, what the trainer packs         workers/trainer.py

Every class here is plain data without torch (the pure core uses them), and the ones that cross
processes are msgspec Structs sent on the control plane as they are (control/messages.py
registers them): no renamed copies. The bytes of a generated trajectory never travel in these
messages: they are one payload, ``TrajectoryTokens`` (prompt and response tokens, behaviour
log-probs, per-token weight versions, a loss mask for environment tokens), the same object from
the engine's output (rollout/engine.py: a Request carries it to resume, a RequestOutput returns
it) through the producing rank's ring (servers/trajectory.py, named by a RecordHandle) to the
trainer's TrajectorySample. Held-out answers take the same path (an Evaluated names a record).
Inside the trainer samples become packed MicroBatches (train/batch.py): that is the trainer's
API, not a step of the path.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import msgspec


@dataclass(frozen=True)
class Prompt:
    """A dataset row with its tokens; one prompt group of N' trajectories is generated from it.

    >>> Prompt(7, "What is 2 + 3?", "5", [1, 2, 3], {"task": "arithmetic"}).prompt_ids
    [1, 2, 3]
    """

    prompt_id: int
    text: str
    answer: str
    prompt_ids: list[int]
    meta: dict = field(default_factory=dict)


class TrajectoryItem(msgspec.Struct, frozen=True):
    """A trajectory waiting in the Trajectory Server: a new one, or an interrupted partial one.

    >>> TrajectoryItem(traj_id=12, group_id=3, traj_version=None, prompt_len=40).tokens
    40
    """

    traj_id: int
    group_id: int
    traj_version: int | None
    """V_traj; None for a new trajectory whose tag is set when it is first routed (dynamic tag)."""
    prompt_len: int
    generated_len: int = 0
    origin: int = -1
    """Instance it was interrupted on (-1: never ran)."""

    @property
    def tokens(self) -> int:
        """KV tokens it brings to an instance (prompt + already generated)."""
        return self.prompt_len + self.generated_len


class RecordHandle(msgspec.Struct, frozen=True, array_like=True):
    """Where a generated trajectory's bytes live: ring of rollout ``rank``, data ``offset`` and
    ``length`` in bytes, ``generation`` (a freed and rewritten slot has another)."""

    rank: int
    offset: int
    length: int
    generation: int


class Route(msgspec.Struct, frozen=True, tag=True):
    """Run a trajectory on an instance: the coordinator decides (traj_id, instance, V_traj); the
    loop adds what the instance needs (prompt tokens, sampling seed, the partial record of an
    interrupted trajectory, a length target) and the runtime sends it to the rank as is.

    >>> Route(traj_id=12, instance=1, traj_version=4).partial is None
    True
    """

    traj_id: int
    instance: int
    traj_version: int
    prompt_ids: list[int] = []
    prompt_len: int = 0
    seed: int = 0
    partial: RecordHandle | None = None
    """The trajectory's newest partial record (it resumes from those tokens)."""
    max_new_tokens: int = 0
    """0: --rollout.max-new-tokens; > 0: this trajectory's own length target (benchmarks, the simulator)."""


class Finished(msgspec.Struct, frozen=True, tag=True):
    """An instance stopped generating a trajectory: done (partial=False), or interrupted with its
    partial output written back (partial=True: it loops back to the Trajectory Server queue). Sent
    by the rollout rank as is; the loop's event.

    >>> Finished(12, 1, RecordHandle(1, 0, 512, 3), n_tokens=96).partial
    False
    """

    traj_id: int
    instance: int
    handle: RecordHandle | None
    n_tokens: int
    partial: bool = False
    finish_reason: str = ""
    cross_node_copies: int = 0
    """Copies of this trajectory's records that crossed nodes since its last Finished (shipped to
    trainer nodes, or a partial record fetched from another node to resume it)."""
    cross_node_bytes: int = 0
    fetched: int = 0
    """Of those copies, partial records fetched from another node to resume the trajectory."""
    turns: int = 0
    """Multi-turn (--env.name): model turns in the trajectory so far (0: a single-turn trajectory)."""
    tool_calls: int = 0
    """Multi-turn: tool calls answered in its turns (a replay on resume counts them again only once)."""
    tool_s: float = 0.0
    """Multi-turn: seconds its environment steps took on this instance since its last Finished
    (replays and re-run calls included: the time they cost)."""
    env_reward: float | None = None
    """Multi-turn: the reward its environment gave at the end (None: the task's reward fn scores it)."""


class TrainGroup(msgspec.Struct, frozen=True, array_like=True):
    """One group of a training batch, sent to every trainer rank as is (TrainStep).

    >>> TrainGroup(3, 4, [12, 13], [RecordHandle(1, 0, 512, 3)] * 2, [1.0, 0.0], [96, 80], 40).traj_version
    4
    """

    group_id: int
    traj_version: int
    """V_traj of the group (min over its members)."""
    traj_ids: list[int]
    handles: list[RecordHandle]
    rewards: list[float]
    n_tokens: list[int]
    prompt_len: int


ENV_LOGPROB = 0.0
"""Behaviour log-prob stored for an environment token (loss_mask 0): no policy sampled it."""
ENV_VERSION = -1
"""Weight version stored for an environment token (loss_mask 0); a model token's is >= 0."""


def _values(x) -> list:
    """A field's values as a new Python list (tensors via tolist, without importing torch)."""
    return x.tolist() if hasattr(x, "tolist") else list(x)


@dataclass
class TrajectoryTokens:
    """The token payload of one trajectory, the same object from the engine's output to the trainer's
    sample: the engine's request and output (rollout/engine.py) and running sequence hold it, the ring
    stores it (servers/trajectory.py), a TrajectorySample wraps it with the reward.

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


@dataclass
class TrajectorySample:
    """One trajectory as the trainer packs it: its ring record read back (the token payload), with the
    group's reward and V_traj.

    >>> TrajectorySample(TrajectoryTokens([1, 2], [5, 6, 7], [-0.1, -0.2, -0.3], [4, 4, 5]), 1.0, 3, 4).tokens.seq_len
    5
    """

    tokens: TrajectoryTokens
    reward: float
    group_id: Hashable
    traj_version: int
    """V_traj: the immutable version the staleness protocol bounds (min over the group)."""

    def validate(self, index: int = 0) -> None:
        """Raise ValueError naming the sample and the inconsistent field."""
        self.tokens.validate(f"sample {index}")
        if not math.isfinite(float(self.reward)):
            raise ValueError(f"sample {index}: reward={self.reward!r} is not a finite number")


FORMS = (Prompt, TrajectoryItem, Route, Finished, TrainGroup, TrajectorySample)
"""The six forms, in path order (docs/architecture.md lists them with their modules)."""
