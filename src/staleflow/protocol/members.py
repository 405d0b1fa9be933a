"""The member table every batch protocol keeps, and the one path by which a member finishes or is aborted.

A prompt group's members (its trajectories) are named by id; ``_trajs`` maps each live member to its
group (``types._Group``: its ``live`` and ``done`` ids). StaleFlow's StalenessManager and the peers'
CountedBuffer both subclass ``Members``: the member rules below are theirs alike (the group rules, where
a group's reservation sits and which batch it joins, are each protocol's own).
"""

from __future__ import annotations

from staleflow.protocol.types import ProtocolError, _Group


class Members:
    """Member id -> its group, with ``complete`` (group redundancy: once N finished, the rest are dropped)
    and ``abort`` (one member dropped; the group too when it can no longer reach N). A subclass provides
    ``abort_group(group_id, reason)`` and may count drops by reason (``_member_dropped``)."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self._trajs: dict = {}  # member id -> its _Group (which reservation, or queue place, a member holds)

    def abort_group(self, group_id, reason: str) -> list:
        raise NotImplementedError

    def _member_dropped(self, reason: str) -> None:
        """A member left without finishing (counted by StalenessManager)."""

    def _drop_member(self, g: _Group, traj_id, reason: str) -> None:
        if traj_id in g.live:
            del g.live[traj_id]
        else:
            del g.done[traj_id]
        del self._trajs[traj_id]
        self._member_dropped(reason)

    def complete(self, traj_id) -> list:
        """A member finished generation; once the group has N, the still-running members are dropped
        (reason "group_redundancy") and returned so the runtime stops them."""
        g = self._trajs.get(traj_id)
        if g is None or traj_id not in g.live:
            state = "already complete" if g is not None else "unknown or aborted"
            raise ProtocolError(f"complete: traj_id {traj_id!r} is {state}")
        del g.live[traj_id]
        g.done[traj_id] = None
        if len(g.done) == self.group_size and g.live:
            surplus = list(g.live)
            for t in surplus:
                self._drop_member(g, t, "group_redundancy")
            return surplus
        return []

    def abort(self, traj_id, reason: str) -> list:
        """Drop one member (crash, failure); returns [group_id] if the group can thereby no longer reach N
        members and was aborted with the same reason, else []."""
        if not isinstance(reason, str) or not reason:
            raise ProtocolError(f"abort reason {reason!r} must be a non-empty str")
        g = self._trajs.get(traj_id)
        if g is None:
            raise ProtocolError(f"abort: unknown (or already aborted/consumed) traj_id {traj_id!r}")
        if g.occupied:
            raise ProtocolError(
                f"abort: traj {traj_id!r} belongs to group {g.group_id!r}, which already occupies buffer {g.buffer}: "
                f"it will be trained"
            )
        self._drop_member(g, traj_id, reason)
        if len(g.done) + len(g.live) < self.group_size:
            self.abort_group(g.group_id, reason)
            return [g.group_id]
        return []
