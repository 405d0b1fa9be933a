"""Plain data of the Snapshot-Command cycle: instance snapshots and commands, and what the
coordinator reads of a trajectory (``TrajFacts``).

The snapshots and commands are msgspec Structs (frozen, tagged where they travel as a union): the
runtime sends them over ZeroMQ as they are (``msgspec.msgpack``, see control/messages.py) and the
simulator passes them around as objects.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from staleflow.trajectory import Route  # (the routed form of a trajectory: staleflow/trajectory.py)


class InstanceSnapshot(msgspec.Struct, frozen=True, tag=True):
    """What one rollout instance reports about itself (every ~10 ms in the real system; sent as is)."""

    instance: int
    version: int
    """Weight version currently loaded."""
    running: int
    """Trajectories decoding now."""
    waiting: int
    """Trajectories queued inside the engine (not yet running)."""
    kv_tokens: int
    kv_capacity: int
    tokens_per_s: float
    syncing: bool
    """A Pull is in progress."""
    time: float
    """Instance-side time the snapshot was taken (same clock as the coordinator's `now`)."""
    traj_ids: tuple[int, ...] = ()
    """Ids of every trajectory the instance holds (running + waiting + parked)."""
    tokens_generated: int = 0
    """Tokens generated since the instance started (throughput metrics)."""
    parked_ids: tuple[int, ...] = ()
    """Ids of the multi-turn trajectories parked on a tool call: their turn ended, the env step runs
    (the engine may hold their KV). Counted neither in ``running`` nor in ``waiting``; a subset of
    ``traj_ids``. A pull leaves them on the instance and migration never picks them (coordinator/pull.py)."""


class TrajFacts(Protocol):
    """What the coordinator reads of one trajectory, looked up by id in the table it is given.

    The table is the ledger's (controller/ledger.py: ``Ledger.trajs``, whose ``Traj`` has these
    fields; controller/build.py hands it to the coordinator once): the one per-trajectory table.
    The coordinator, its queue and its strategies keep ids and read these facts when they need them;
    they never write them (the loop does, from the events). Declared here, in the coordinator, so
    that the coordinator names what it reads without importing the controller (which imports it).
    A routing strategy's ``choose`` receives one of these.
    """

    @property
    def traj_id(self) -> int: ...

    @property
    def group_id(self) -> int: ...

    @property
    def traj_version(self) -> int | None:
        """V_traj, written once at its first route (None: never routed)."""

    @property
    def prompt_len(self) -> int: ...

    @property
    def n_tokens(self) -> int:
        """Tokens generated so far (an interrupted trajectory's partial record)."""

    @property
    def origin(self) -> int:
        """The instance it was last interrupted on (-1: never interrupted)."""

    @property
    def tokens(self) -> int:
        """KV tokens it brings to an instance: prompt + generated so far."""


class Pull(msgspec.Struct, frozen=True, tag=True):
    """Instance loads weight version `version` from the PS (after an Interrupt of its in-flight work)."""

    instance: int
    version: int


class Interrupt(msgspec.Struct, frozen=True, tag=True):
    """Stop trajectories on an instance and return their partial output to the TS.

    reason: "pull" (before a weight load), "migrate" (re-route elsewhere), "truncate" (stuck-buffer
    straggler: the partial output is final; the runtime reports it through on_finished).
    """

    instance: int
    traj_ids: tuple[int, ...]
    reason: str = "migrate"


class Abort(msgspec.Struct, frozen=True, tag=True):
    """Drop trajectories for good (instance -1: they were queued in the TS, nothing to stop).

    reason: "surplus" (redundancy), "window-closed" (no admissible buffer left), "straggler"
    (stuck buffer) or a failure reason. group_id >= 0 marks the end of a whole-group abort: the
    runtime also discards the group's finished members, and with retry=True resubmits the
    prompt as a fresh group (new ids).
    """

    instance: int
    traj_ids: tuple[int, ...]
    reason: str
    retry: bool = False
    group_id: int = -1


class Lane(msgspec.Struct, frozen=True, tag=True):
    """A planner keeps ``instance`` for the work it routes there itself (``open``) or gives it back to the
    routing pass (tail lanes, coordinator/lanes.py). The coordinator's own state: never sent to a rank."""

    instance: int
    open: bool = True


Command = Route | Pull | Interrupt | Abort
"""What the coordinator sends to the runtime (and the simulator) to execute."""
