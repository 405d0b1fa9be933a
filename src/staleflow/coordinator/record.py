"""One scheduling record per live trajectory, and the one function that writes it.

The coordinator keeps, for every trajectory it schedules (from ``submit`` until it finishes or is
dropped), ONE ``SchedRecord``: where it is (queued in the Trajectory Server, in flight on an
instance, interrupting, parked on a tool call, held out of the queue for truncation), its group,
its reservation, its arrival number and queue place, and its migration marks. ``Schedule`` holds the
records (the table) and ``Schedule.transition`` is their only writer: it moves a record from one state
to the next and keeps the two readers in step, the multi-level queue (coordinator/mlq.py: sort keys, no
ids of its own) and the instance views (coordinator/instance.py: the records each instance holds, in
routing order: the one index). A record is read-only to everyone else (strategies read it through the
coordinator's view, coordinator/view.py); writing an attribute raises.

    sched.transition(t, SUBMIT, group_id=g, traj_version=None, tokens=40)   # queued (new prompt)
    sched.transition(t, ROUTE, instance=1, kv=40, now=now)                  # in flight on instance 1
    sched.transition(t, INTERRUPT, now=now, reason="migrate")               # interrupting (marks the move)
    sched.transition(t, LOOP_BACK, now=now, traj_version=0, tokens=52)      # queued again under V_traj 0
    sched.transition(t, END, now=now)                                        # finished or dropped: gone

What a trajectory IS (group, V_traj, lengths, origin, handle, reward) is the ledger's ``Traj``
(controller/ledger.py), read by id; this record says only where the coordinator has it.
"""

from __future__ import annotations

from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.mlq import MultiLevelQueue

SUBMIT, RESERVE, ROUTE, INTERRUPT, PARK, UNPARK, LOOP_BACK, TRUNCATE, END = (
    "submit",
    "reserve",
    "route",
    "interrupt",
    "park",
    "unpark",
    "loop_back",
    "truncate",
    "end",
)
"""The transitions (``Schedule.transition``'s ``event``)."""

QUEUED, IN_FLIGHT, INTERRUPTING, PARKED, TRUNCATING = "queued", "in_flight", "interrupting", "parked", "truncating"
"""The states a record names (``SchedRecord.state``)."""

_set = object.__setattr__  # the transition function's write (a record refuses plain attribute writes)


class SchedRecord:
    """Where the coordinator has one live trajectory (read-only outside ``Schedule.transition``)."""

    __slots__ = (
        "traj_id",
        "group_id",
        "instance",
        "kv",
        "reserved",
        "interrupting",
        "parked",
        "arrival",
        "place",
        "migrated_at",
        "moved_off",
    )

    def __init__(self, traj_id: int, group_id: int):
        _set(self, "traj_id", traj_id)
        _set(self, "group_id", group_id)
        _set(self, "instance", -1)
        """The instance holding it (in flight, interrupting or parked); -1: none."""
        _set(self, "kv", 0)
        """KV tokens it brought to that instance when routed (prompt + generated so far)."""
        _set(self, "reserved", False)
        """It holds a reservation in the batch protocol (from its first route until it ends)."""
        _set(self, "interrupting", False)
        """An Interrupt (pull or migration) was sent; its partial output has not come back yet."""
        _set(self, "parked", False)
        """Parked on a tool call (the instance's last accepted snapshot says so): it decodes nothing."""
        _set(self, "arrival", -1)
        """Its first arrival number in the queue (FIFO ties; a loop-back keeps it)."""
        _set(self, "place", None)
        """Its place in the multi-level queue while queued (MultiLevelQueue.push's), else None."""
        _set(self, "migrated_at", None)
        """When it was migrated (at most once per trajectory), else None."""
        _set(self, "moved_off", -1)
        """The instance a migration took it off, until it is routed again (-1: none)."""

    def __setattr__(self, name, value):
        raise AttributeError(
            f"SchedRecord.{name} is read-only: the coordinator's Schedule.transition is the only writer "
            f"(a strategy returns commands instead, coordinator/strategies.py)"
        )

    @property
    def state(self) -> str:
        """queued, in_flight, interrupting, parked or truncating (out of the queue, its partial is final)."""
        if self.place is not None:
            return QUEUED
        if self.instance < 0:
            return TRUNCATING
        if self.interrupting:
            return INTERRUPTING
        return PARKED if self.parked else IN_FLIGHT

    def __repr__(self) -> str:
        return f"SchedRecord({self.traj_id}, group {self.group_id}, {self.state}, instance {self.instance})"


class Schedule:
    """The record table of the live trajectories and its transition function."""

    __slots__ = ("records", "queue", "instances", "reserved", "interrupting")

    def __init__(self, queue: MultiLevelQueue, instances: dict[int, InstanceState]):
        self.records: dict[int, SchedRecord] = {}
        """traj_id -> its record, for every live trajectory (queued or held by an instance)."""
        self.queue, self.instances = queue, instances
        self.reserved = 0
        """Records holding a reservation (the coordinator's ``in_flight``)."""
        self.interrupting = 0
        """Records whose Interrupt has not come back yet (routing and migration wait for them)."""

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, traj_id: int) -> bool:
        return traj_id in self.records

    def get(self, traj_id: int) -> SchedRecord | None:
        return self.records.get(traj_id)

    def group_members(self, group_id: int) -> list[int]:
        """The group's live trajectories here (queued or held), by id (rare: group aborts, stragglers)."""
        return sorted(t for t, r in self.records.items() if r.group_id == group_id)

    def transition(
        self,
        traj_id: int,
        event: str,
        *,
        instance: int = -1,
        kv: int = 0,
        now: float = 0.0,
        group_id: int = -1,
        traj_version: int | None = None,
        tokens: int = 0,
        reason: str = "",
    ) -> SchedRecord | None:
        """Move trajectory ``traj_id``'s record through ``event``; the only writer of records.

        SUBMIT (group_id, traj_version, tokens): a new record, queued under V_traj (None: untagged).
        RESERVE: it holds a reservation (ROUTE also sets it). ROUTE (instance, kv, now): queued -> in
        flight on ``instance`` with ``kv`` tokens; a migration's mark ``moved_off`` is cleared. INTERRUPT
        (now, reason): an Interrupt was sent; reason "migrate" marks the move (when, and the instance it
        leaves). PARK / UNPARK: a snapshot says it waits on a tool call / decodes again. LOOP_BACK (now,
        traj_version, tokens): its partial output came back: off the instance, queued again. TRUNCATE: a
        straggler's partial is final: out of the queue. END (now): finished or dropped: off the queue and
        the instance, record deleted (returned, as for every event). ValueError for an event the state
        does not allow (the caller's bug, nothing is changed)."""
        rec = self.records.get(traj_id)
        if event == ROUTE:
            if rec is None or rec.place is None:
                raise ValueError(f"route: trajectory {traj_id} is not queued ({rec!r})")
            inst = self.instances[instance]
            self.queue.remove(rec.place)
            _set(rec, "place", None)
            if not rec.reserved:
                _set(rec, "reserved", True)
                self.reserved += 1
            _set(rec, "instance", instance)
            _set(rec, "kv", kv)
            _set(rec, "moved_off", -1)
            inst._hold(rec, now)
            return rec
        if event == SUBMIT:
            if rec is not None:
                raise ValueError(f"submit: trajectory id {traj_id} is already live; ids must be unique")
            rec = SchedRecord(traj_id, group_id)
            self.records[traj_id] = rec
            self._enqueue(rec, traj_version, tokens)
            return rec
        if rec is None:
            raise ValueError(f"{event}: trajectory {traj_id} is not live in the coordinator")
        if event == END:
            if rec.place is not None:
                self.queue.remove(rec.place)
            if rec.instance >= 0:
                self.instances[rec.instance]._release(rec, now)
            self.reserved -= rec.reserved
            self.interrupting -= rec.interrupting
            del self.records[traj_id]
            return rec
        if event == INTERRUPT:
            self._held(rec, event)
            if not rec.interrupting:
                _set(rec, "interrupting", True)
                self.interrupting += 1
            if reason == "migrate":
                _set(rec, "migrated_at", now)
                _set(rec, "moved_off", rec.instance)
            return rec
        if event == LOOP_BACK:
            if rec.place is not None:
                raise ValueError(f"trajectory {traj_id} is already queued; a loop-back must follow its route")
            if rec.instance >= 0:
                self.instances[rec.instance]._release(rec, now)
                _set(rec, "instance", -1)
            if rec.interrupting:
                _set(rec, "interrupting", False)
                self.interrupting -= 1
            self._enqueue(rec, traj_version, tokens)
            return rec
        if event in (PARK, UNPARK):
            self._held(rec, event)
            if rec.parked != (event == PARK):
                _set(rec, "parked", event == PARK)
                self.instances[rec.instance]._parked_changed(rec)
            return rec
        if event == RESERVE:
            if not rec.reserved:
                _set(rec, "reserved", True)
                self.reserved += 1
            return rec
        if event == TRUNCATE:
            if rec.place is not None:
                self.queue.remove(rec.place)
                _set(rec, "place", None)
            return rec
        raise ValueError(f"unknown scheduling event {event!r}")

    def _enqueue(self, rec: SchedRecord, traj_version: int | None, tokens: int) -> None:
        if rec.arrival < 0:  # a loop-back keeps its first arrival (FIFO: it does not go behind newer work)
            _set(rec, "arrival", self.queue.next_arrival())
        _set(rec, "parked", False)
        _set(rec, "place", self.queue.push(rec.traj_id, traj_version, tokens, rec.arrival))

    @staticmethod
    def _held(rec: SchedRecord, event: str) -> None:
        if rec.instance < 0:
            raise ValueError(f"{event}: trajectory {rec.traj_id} is not on an instance ({rec!r})")
