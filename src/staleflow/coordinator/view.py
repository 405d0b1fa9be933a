"""What a strategy reads of the coordinator: a read-only view (it returns commands; the coordinator applies them).

Every strategy (routing, pull, migration, stragglers, a fork's planner) is handed this view as ``ctx``,
never the Coordinator itself. Nothing here writes: the instances and the scheduling records it hands out
refuse attribute writes (coordinator/instance.py, coordinator/record.py), ``instances`` and ``trajs``
are read-only mappings, and the view has no setter. What a strategy decides comes back as commands
(Route, Interrupt, Pull, Abort: coordinator/types.py), which the coordinator checks and applies
(Coordinator.apply), so the one writer of the scheduling state stays the coordinator's transition
function, whatever a fork's strategy does.

    view.ps_version, view.now, view.cfg, view.cost_model        # settings and clocks
    view.instances[i].target_version, .load, .trajs, ...         # InstanceState, read-only
    view.record(traj_id).state, .instance, .migrated_at, ...     # SchedRecord, read-only (None: not live)
    view.trajs[traj_id].tokens                                    # the ledger's facts (TrajFacts)
    view.routable_at(v), view.in_flight, view.interrupting, view.group_version(gid), view.group_versions(),
    view.can_admit(V, gid)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType


class CoordinatorView:
    __slots__ = ("_c", "instances", "trajs", "routable_at")

    def __init__(self, coordinator):
        object.__setattr__(self, "_c", coordinator)
        object.__setattr__(self, "instances", MappingProxyType(coordinator.instances))
        """instance id -> InstanceState (read-only)."""
        trajs = coordinator.trajs
        object.__setattr__(self, "trajs", trajs if isinstance(trajs, MappingProxyType) else MappingProxyType(trajs))
        """traj_id -> the ledger's record (TrajFacts): read it, never write it."""
        object.__setattr__(self, "routable_at", coordinator.routing.routable_at)
        """routable_at(version): could some queued trajectory be routed to an instance running ``version``?
        (The routing pass's own method, bound once: the pull policy asks it for every instance every tick.)"""

    def __setattr__(self, name, value):
        raise AttributeError(f"the coordinator's view is read-only ({name}): a strategy returns commands")

    @property
    def cfg(self):
        """The (frozen, resolved) CoordinatorConfig."""
        return self._c.cfg

    @property
    def cost_model(self):
        return self._c.cost_model

    @property
    def ps_version(self) -> int:
        """Newest version the instances may pull (every T-th published one under verl's T)."""
        return self._c.ps_version

    @property
    def now(self) -> float:
        """Time of the tick in progress."""
        return self._c.now

    @property
    def in_flight(self) -> int:
        """Trajectories holding a reservation and not yet finished (queued loop-backs included)."""
        return self._c.sched.reserved

    @property
    def interrupting(self) -> int:
        """Trajectories whose Interrupt has not come back yet."""
        return self._c.sched.interrupting

    @property
    def queued(self) -> int:
        return len(self._c.queue)

    def queued_ids(self) -> Iterator[int]:
        """Every queued id, in the queue's service order."""
        return self._c.queue.ids()

    def record(self, traj_id: int):
        """The trajectory's scheduling record (read-only SchedRecord), None when it is not live here."""
        return self._c.sched.get(traj_id)

    def records(self) -> Mapping:
        """traj_id -> SchedRecord of every live trajectory (read-only)."""
        return MappingProxyType(self._c.sched.records)

    def group_version(self, group_id: int) -> int | None:
        """The group's V_traj once its first member was routed (None: not yet)."""
        return self._c.group_tag.get(group_id)

    def group_versions(self) -> Mapping[int, int]:
        """group_id -> V_traj of every live group routed so far (read-only; a planner's loop over many groups)."""
        return MappingProxyType(self._c.group_tag)

    def group_live(self, group_id: int) -> bool:
        """The group was routed and is not occupied or aborted yet."""
        return group_id in self._c.group_tag

    def group_members(self, group_id: int) -> list[int]:
        """The group's live trajectories here (queued or held), by id."""
        return self._c.sched.group_members(group_id)

    def can_admit(self, traj_version: int, group_id=None) -> bool:
        """Whether the batch protocol would reserve for this V_traj (a group's new member) now."""
        return self._c.manager.can_admit(traj_version, group_id)

    @property
    def eta(self) -> int:
        """The staleness bound of the run's batch protocol."""
        return self._c.manager.eta

    @property
    def buffer_version(self) -> int:
        """The next buffer the trainer consumes (= the newest model version that can exist)."""
        return self._c.manager.version

    def stuck_stragglers(self, threshold: int) -> list:
        """Groups holding the last <= threshold reservations of a Stuck next buffer (the protocol's answer)."""
        return self._c.manager.stuck_stragglers(threshold)
