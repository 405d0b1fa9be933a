"""The one interface of a batch protocol: what the coordinator and the controller loop call.

StaleFlow's StalenessManager (per-trajectory Reserve / Occupy / Consume) and the baselines'
count-based rules (modes/areal.py, modes/verl.py, on protocol/counted.py) implement it, so one coordinator and one
loop run every system; the resolved mode builds its implementation (staleflow.modes: ``Mode.protocol``).

Call order (coordinator and loop): ``can_admit`` then ``reserve`` when a trajectory is routed;
``complete`` when it finishes; ``occupy`` once its group's N members are rewarded;
``ready_version`` / ``consume`` by the trainer; ``abort`` / ``abort_group`` for dropped work;
``closed_windows`` / ``stuck_stragglers`` each tick; ``on_rollout_version`` when every instance
runs a new version (a global weight update finished).
"""

from __future__ import annotations

from typing import Protocol

from staleflow.protocol.types import StalenessSpec


class BatchProtocol(Protocol):
    spec: StalenessSpec
    """What it was built from (eta, B, B', N, N', the start version); the fields below copy it."""
    eta: int
    batch_size: int
    capacity: int
    group_size: int
    group_capacity: int
    version: int
    """Next batch the trainer consumes (= the newest model version that can exist)."""
    bounded: bool
    """True: every consumed group has V_traj <= V_buf <= V_traj + eta by construction (the loop treats a
    breach as a violation). False (count-based peers): only V_traj <= V_buf holds; groups beyond eta are
    counted and reported, not errors."""

    def can_admit(self, traj_version: int, group_id=None) -> bool: ...

    def reserve(self, traj_id, group_id, traj_version: int) -> int: ...

    def complete(self, traj_id) -> list: ...

    def occupy(self, group_id) -> int: ...

    def ready_version(self) -> int | None: ...

    def consume(self, v: int) -> list: ...

    def abort(self, traj_id, reason: str) -> list: ...

    def abort_group(self, group_id, reason: str) -> list: ...

    def closed_windows(self) -> list: ...

    def stuck_stragglers(self, threshold: int) -> list: ...

    def on_rollout_version(self, version: int) -> None: ...

    def group_info(self, group_id) -> dict: ...

    def buffer_state(self, v: int): ...

    def consumption_log(self) -> list[tuple]: ...

    def stats(self) -> dict: ...

    def validate(self) -> None: ...
