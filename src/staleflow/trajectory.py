"""The forms a trajectory takes from prompt to loss: one class per step where the data changes.

    Prompt            a dataset row, tokenized                      data/source.py yields it
      (queued by id)      its members wait in the Trajectory Server: the ledger's Traj   loop -> coordinator
      -> Route            sent to an instance, as is (V_traj fixed, prompt, seed)  coordinator -> loop -> rank
      -> Finished         generated: its tokens sit in a ring (RecordHandle)       rank -> loop
      -> TrainGroup       a consumed group: handles, rewards, V_traj               loop -> trainer ranks
                          (the trainer reads its members' payloads back from the rings and trains
                          on the group and the payloads: Trainer.step(groups, payloads))

Every class here is plain data without torch (the pure core uses them), and the ones that cross
processes are msgspec Structs sent on the control plane as they are (control/messages.py
registers them): no renamed copies. The bytes of a generated trajectory never travel in these
messages: they are one payload, ``TrajectoryTokens`` (prompt and response tokens, behaviour
log-probs, per-token weight versions, a loss mask for environment tokens), the same object from
the engine's output (rollout/engine.py: a Request carries it in, the finished Request returns
it) through the producing rank's ring (servers/trajectory.py, named by a RecordHandle) to the
trainer, which takes each TrainGroup with its members' payloads (the group already holds the reward
and V_traj: no class repeats them per trajectory). Held-out answers take the same path (an Evaluated
names a record). Inside the trainer the payloads become packed MicroBatches (train/batch.py): that
is the trainer's API, not a step of the path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from staleflow.tokens import ENV_LOGPROB as ENV_LOGPROB  # the payload's names, re-exported: the path's one import
from staleflow.tokens import ENV_VERSION as ENV_VERSION
from staleflow.tokens import TrajectoryTokens as TrajectoryTokens
from staleflow.tokens import model_versions as model_versions


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
    answer: str = ""
    meta: dict[str, Any] = {}
    """Multi-turn runs (--env.name): the data row's answer and meta fields, for the environment's reset
    (a code-test env reads its tests there); empty otherwise (the Workload's env_fields)."""


class TurnStats(msgspec.Struct):
    """A multi-turn trajectory's figures (--env.name), declared once: the rank's turn driver counts them,
    its Finished carries them, the ledger's Traj keeps them (tool seconds summed over every instance).

    >>> TurnStats(turns=2, tool_calls=1, tool_s=0.25).env_reward is None
    True
    """

    turns: int = 0
    """Model turns in the trajectory so far."""
    tool_calls: int = 0
    """Tool calls answered in its turns (a replay on resume counts them again only once)."""
    tool_s: float = 0.0
    """Seconds its environment steps took: in a Finished, on that instance since its last Finished (replays and
    re-run calls included: the time they cost); in the ledger, over every instance."""
    env_reward: float | None = None
    """The reward its environment gave at the end (None: the task's reward fn scores it)."""


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
    stats: TurnStats | None = None
    """Multi-turn (--env.name): its turns, tool calls, tool seconds and environment reward (None: single-turn)."""


class TrainGroup(msgspec.Struct, frozen=True, array_like=True):
    """One group of a training batch, sent to every trainer rank as is (TrainStep). Each trainer rank
    reads its members' payloads back through ``handles`` and trains on the group with them
    (``Trainer.step(groups, payloads)``, payloads in ``traj_ids`` order): the reward and V_traj stay here.

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


FORMS = (Prompt, Route, Finished, TrainGroup)
"""The four forms, in path order (docs/architecture.md lists them with their modules)."""
