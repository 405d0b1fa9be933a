"""The count-based batch protocol of the asynchronous peers (AReaL, verl fully-async), pure Python.

Peers admit new prompt groups by a counter instead of per-trajectory reservations, queue the
groups as they complete, and train on batches of B taken from that queue; nothing bounds a single
trajectory's staleness (a group admitted at version V may be trained at V + eta + k). This base
class holds what they share (the group table, member completion and redundancy, the queue of
completed groups, consume, aborts, the consumption log); a subclass supplies the admission rule
(``_room``), the counter updates (``_admitted`` / ``_left``) and the batch order (``_batch``).
It implements protocol/interface.py, so the same coordinator and controller loop drive it.

``strict=True`` is a variant the peers do not have (the grid's "strict" column): a group whose
staleness would exceed eta is dropped and its prompt regenerated instead of trained. A group in
flight or queued with V_traj + eta < the next batch can never be trained within eta, so it is
reported by ``closed_windows`` (the coordinator aborts it with retry) and never batched; the
variant is then bounded like StaleFlow, but it trains what finishes in time (shorter responses).
"""

from __future__ import annotations

from staleflow.protocol.members import Members
from staleflow.protocol.types import BufferState, ProtocolError, StalenessSpec, _check_id, _Group


class CountedBuffer(Members):
    bounded = False
    retry_closed = False
    """Groups reported by closed_windows are regenerated (the strict variant), not just dropped."""

    def __init__(self, spec: StalenessSpec, strict: bool = False):
        name = type(self).__name__
        if not isinstance(spec, StalenessSpec):
            raise ProtocolError(f"{name} takes a StalenessSpec, got {type(spec).__name__}")
        self.spec = spec
        eta, batch_size, capacity, version = spec.eta, spec.batch_size, spec.capacity, spec.version
        if capacity != batch_size:
            raise ProtocolError(
                f"{name} capacity={capacity!r}: batch redundancy (B' > B) is StaleFlow's; "
                f"the peer trains every completed group, so use --staleness.batch-redundancy 0"
            )
        if not isinstance(strict, bool):
            raise ProtocolError(f"{name} strict={strict!r} must be a bool")
        super().__init__(spec.group_size)  # the member table (protocol/members.py): complete, abort
        self.strict = self.bounded = self.retry_closed = strict
        self.eta, self.batch_size, self.capacity = eta, batch_size, batch_size
        self.group_capacity = spec.group_capacity
        self.version = version
        self.rollout_version = version
        """Version every rollout instance runs (set when a global weight update finishes)."""
        self._groups: dict = {}  # in flight or completed-and-queued
        self._queue: list = []  # completed group ids, in completion order
        self._seq: dict = {}  # group_id -> admission number (start order)
        self._next_seq = 0
        self._finished: dict = {}  # group_id -> "consumed" | "aborted: <reason>"
        self._log: list[tuple] = []
        self._aborted: dict = {}

    # ---- the peer's rule (subclasses) ------------------------------------------------------
    def _room(self, traj_version: int) -> bool:
        raise NotImplementedError

    def _admitted(self, g: _Group) -> None:
        """A new group started (count it)."""

    def _left(self, g: _Group, completed: bool) -> None:
        """An in-flight group completed (queued for training) or was dropped."""

    def _batch(self, queue: list) -> list:
        """The B group ids of `queue` (completed groups, completion order) the trainer takes next."""
        raise NotImplementedError

    def _unqueued(self, g: _Group) -> None:
        """A completed, queued group was dropped (strict variant: it became over-stale)."""

    def on_rollout_version(self, version: int) -> None:
        self.rollout_version = max(self.rollout_version, version)

    # ---- queries -----------------------------------------------------------------------------
    def _check_version(self, V) -> int:
        if type(V) is not int or not 0 <= V <= self.version:
            raise ProtocolError(f"traj_version {V!r} must be an int in [0, {self.version}] (the newest model)")
        return V

    def _joinable(self, g: _Group) -> bool:
        return not g.occupied and len(g.done) < self.group_size and len(g.live) + len(g.done) < self.group_capacity

    def can_admit(self, traj_version: int, group_id=None) -> bool:
        """A new group (or a new member of in-flight `group_id`) may start at this V_traj now."""
        self._check_version(traj_version)
        if group_id is not None:
            if group_id in self._groups:
                return self._joinable(self._groups[group_id])
            if group_id in self._finished:
                return False
        return self._room(traj_version)

    def _over_stale(self, g: _Group) -> bool:
        return self.strict and g.traj_version + self.eta < self.version

    def _trainable(self) -> list:
        """Queued groups the next batch may take (strict: those still within eta)."""
        if not self.strict:
            return self._queue
        return [gid for gid in self._queue if not self._over_stale(self._groups[gid])]

    def ready_version(self) -> int | None:
        return self.version if len(self._trainable()) >= self.batch_size else None

    def buffer_state(self, v: int) -> BufferState:
        if v < self.version:
            raise ProtocolError(f"batch {v} was already consumed (next is {self.version})")
        return BufferState.READY if v == self.version and self.ready_version() is not None else BufferState.WAITING

    def group_info(self, group_id) -> dict:
        g = self._groups.get(group_id)
        if g is None:
            state = self._finished.get(group_id)
            raise ProtocolError(f"group {group_id!r} is {state}" if state else f"unknown group id {group_id!r}")
        return g.info("closed" if self._over_stale(g) else ("occupied" if g.occupied else "reserved"))

    def closed_windows(self) -> list:
        """Strict variant: groups (in flight or queued) that can no longer be trained within eta.
        Otherwise none: the peers have no windows, nothing ever becomes unplaceable."""
        if not self.strict:
            return []
        return [gid for gid, g in self._groups.items() if self._over_stale(g)]

    def stuck_stragglers(self, threshold: int) -> list:
        if not isinstance(threshold, int) or threshold < 1:
            raise ProtocolError(f"stuck_stragglers threshold {threshold!r} must be an int >= 1")
        return []  # no reserved slots, so no Stuck batch

    def consumption_log(self) -> list[tuple]:
        return list(self._log)

    def aborted_groups(self) -> dict:
        return dict(self._aborted)

    def over_eta(self) -> int:
        """Consumed groups whose staleness exceeded eta (the peer allows it; we report it)."""
        return sum(1 for _, tv, bv in self._log if bv - tv > self.eta)

    # ---- operations --------------------------------------------------------------------------
    def reserve(self, traj_id, group_id, traj_version: int) -> int:
        """Start a trajectory: a new group is admitted (the counter moves), a member joins its group.
        Returns V_traj (there is no buffer to reserve)."""
        _check_id("traj_id", traj_id)
        _check_id("group_id", group_id)
        V = self._check_version(traj_version)
        if traj_id in self._trajs:
            raise ProtocolError(f"traj_id {traj_id!r} is already started (group {self._trajs[traj_id].group_id!r})")
        g = self._groups.get(group_id)
        if g is not None:
            if not self._joinable(g):
                raise ProtocolError(f"group {group_id!r} takes no new member {traj_id!r} (complete, full or queued)")
            g.live[traj_id] = None
            g.traj_version = min(g.traj_version, V)
        else:
            if group_id in self._finished:
                raise ProtocolError(f"group {group_id!r} is already {self._finished[group_id]}; use a new group id")
            if not self._room(V):
                raise ProtocolError(
                    f"group {group_id!r} at version {V} is not admissible now (check can_admit "
                    f"first; it waits in the Trajectory Server)"
                )
            g = self._groups[group_id] = _Group(group_id, V, None, traj_id)
            self._seq[group_id] = self._next_seq
            self._next_seq += 1
            self._admitted(g)
        self._trajs[traj_id] = g
        return V

    def occupy(self, group_id) -> int:
        """The group's N members are rewarded: it joins the queue of completed groups."""
        g = self._groups.get(group_id)
        if g is None:
            self.group_info(group_id)  # raises with the reason
        if g.occupied:
            raise ProtocolError(f"group {group_id!r} is already queued for training")
        if self._over_stale(g):
            raise ProtocolError(
                f"group {group_id!r} (V_traj {g.traj_version}) can no longer be trained within "
                f"eta={self.eta} (next batch {self.version}): the strict variant aborts it"
            )
        if len(g.done) < self.group_size:
            raise ProtocolError(
                f"group {group_id!r} has {len(g.done)} of group_size={self.group_size} members "
                f"complete: occupy after generation and reward of the group"
            )
        g.occupied, g.buffer = True, self.version
        self._queue.append(group_id)
        self._left(g, completed=True)
        return self.version

    def consume(self, v: int) -> list:
        if v != self.version or self.ready_version() is None:
            raise ProtocolError(
                f"consume({v!r}): the next batch is {self.version} and it has "
                f"{len(self._queue)}/{self.batch_size} completed groups"
            )
        batch = self._batch(self._trainable())
        taken = set(batch)
        self._queue = [gid for gid in self._queue if gid not in taken]
        for gid in batch:
            g = self._groups.pop(gid)
            for t in g.done:
                del self._trajs[t]
            self._log.append((gid, g.traj_version, v))
            self._finished[gid] = "consumed"
        self.version += 1
        return batch

    def abort_group(self, group_id, reason: str) -> list:
        if not isinstance(reason, str) or not reason:
            raise ProtocolError(f"abort_group reason {reason!r} must be a non-empty str")
        g = self._groups.get(group_id)
        if g is None:
            self.group_info(group_id)
        if g.occupied and not self._over_stale(g):
            raise ProtocolError(f"abort_group: group {group_id!r} is already queued for training")
        live = list(g.live)
        for t in live + list(g.done):
            del self._trajs[t]
        del self._groups[group_id]
        self._aborted[group_id] = reason
        self._finished[group_id] = f"aborted: {reason}"
        if g.occupied:  # strict: an over-stale queued group leaves the queue (its slot is freed)
            self._queue.remove(group_id)
            self._unqueued(g)
        else:
            self._left(g, completed=False)  # rejected work frees its slot (AReaL: not counted as accepted)
        return live

    # ---- metrics and self-check --------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "version": self.version,
            "rollout_version": self.rollout_version,
            "queued": len(self._queue),
            "groups_in_flight": sum(1 for g in self._groups.values() if not g.occupied),
            "groups_consumed": len(self._log),
            "groups_aborted": len(self._aborted),
            "consumed_over_eta": self.over_eta(),
            **self._counters(),
        }

    def _counters(self) -> dict:
        return {}

    def validate(self) -> None:
        def fail(msg):
            raise ProtocolError(f"{type(self).__name__} state is inconsistent: {msg}")

        queued = [gid for gid, g in self._groups.items() if g.occupied]
        if sorted(queued, key=str) != sorted(self._queue, key=str) or len(set(self._queue)) != len(self._queue):
            fail("the queue does not match the completed groups")
        n = sum(len(g.live) + len(g.done) for g in self._groups.values())
        if n != len(self._trajs):
            fail(f"{len(self._trajs)} indexed trajectories but {n} group members")
        logged = [gid for gid, _, _ in self._log]
        if len(set(logged)) != len(logged) or set(logged) & set(self._aborted) or set(logged) & set(self._groups):
            fail("a group is consumed twice, or both consumed and aborted or live")
        if any(not tv <= bv for _, tv, bv in self._log):
            fail("a group was trained before its version existed")
        if self.strict and any(bv > tv + self.eta for _, tv, bv in self._log):
            fail("the strict variant trained a group beyond eta")
