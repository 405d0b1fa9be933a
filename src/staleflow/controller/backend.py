"""What the controller loop drives: a Backend (the real ranks, or the simulator's model of them).

The loop (controller/loop.py) decides; a backend carries decisions out and reports what
happened. The runtime implements it over ZeroMQ and the ranks (runtime/backend.py); the
simulator implements it as its discrete-event model (sim/backend.py). Because both run the same
loop, every mode, strategy and piece of bookkeeping behaves the same in both by construction.

Commands go out as the coordinator's own structs (Route, Interrupt, Pull, Abort); events come
back as Finished (staleflow/trajectory.py), the small structs below and the coordinator's
InstanceSnapshot.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import msgspec

from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull
from staleflow.trajectory import Finished, Route, TrainGroup


class Rewarded(msgspec.Struct, frozen=True):
    traj_id: int
    reward: float
    error: str = ""
    """Non-empty when the reward function failed (the reward is then 0)."""
    text: str = ""
    """The decoded response that was scored (the runtime's trained.jsonl shows one per group)."""


class PullDone(msgspec.Struct, frozen=True):
    instance: int
    version: int
    seconds: float = 0.0


class TrainDone(msgspec.Struct, frozen=True):
    """The trainer finished buffer version-1 and can take the next one."""

    version: int
    metrics: dict = {}
    train_s: float = 0.0
    push_s: float = 0.0
    content: dict = {}
    """group id -> the trained members' content digests (runtime only: trained.jsonl's audit trail)."""
    token_versions: dict = {}
    """group id -> each member's [[version, tokens], ...] (runtime only: trained.jsonl)."""


class Published(msgspec.Struct, frozen=True):
    """Weights of `version` are in the Parameter Server (instances may pull them)."""

    version: int


Event = Finished | Rewarded | PullDone | TrainDone | Published | InstanceSnapshot
"""What every backend yields. A front end may add events of its own (the runtime's checkpoint and
held-out answers) by giving the loop a listener for their type (ControllerLoop(listeners=...))."""


class Backend(Protocol):
    def now(self) -> float:
        """The loop's clock (seconds; monotonic in the runtime, simulated time in the simulator)."""

    def poll(self, until: float) -> Iterable[Event]:
        """Events up to time `until` (waiting or simulating until then); `until <= now()` only
        returns what is already there. Events produced while the caller handles earlier ones
        (a reward of a finish just handled) may be yielded by the same iteration."""

    def route(self, cmd: Route) -> None:
        """Start (or resume, from cmd.partial) a trajectory on cmd.instance: the Route is complete
        (prompt tokens, seed, length target), and the runtime sends it to the rank as is."""

    def interrupt(self, cmd: Interrupt) -> None:
        """Stop trajectories; each comes back as Finished(partial=True) with its record."""

    def abort(self, cmd: Abort) -> None:
        """Stop trajectories on cmd.instance for good; their outputs are discarded."""

    def pull(self, cmd: Pull) -> None:
        """Instance loads the newest weights (>= cmd.version); PullDone follows."""

    def free(self, handles: list) -> None:
        """Records nobody needs any more (consumed, aborted or superseded)."""

    def score(self, traj_id: int, handle: Any, prompt: Any) -> None:
        """Compute the reward of a finished trajectory; Rewarded follows."""

    def train(self, version: int, batch: list[TrainGroup]) -> None:
        """Train buffer `version`; TrainDone(version + 1) and Published(version + 1) follow."""
