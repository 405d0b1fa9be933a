"""The coordinator's speculative view of one rollout instance (paper section 6.1).

Updated at once by the coordinator's own commands (a Route adds a trajectory and its KV tokens,
a finish or interrupt removes them: coordinator/record.py's transition function calls ``_hold`` and
``_release``) and overwritten by a snapshot only when the snapshot is newer than the last local change
and agrees with the locally tracked trajectory count, so the coordinator never acts on outdated
information. The snapshot also names the trajectories parked on a tool call (their records' ``parked``):
they hold the instance (and maybe KV) but do not decode, so a pull leaves them in place and migration
never moves them.

Read-only outside the coordinator: strategies read it (their candidates, the view's ``instances``);
writing an attribute raises, and ``trajs`` is a read-only mapping (traj_id -> its SchedRecord).
"""

from __future__ import annotations

from types import MappingProxyType

from staleflow.coordinator.types import InstanceSnapshot

_set = object.__setattr__  # the coordinator's write (an InstanceState refuses plain attribute writes)


class InstanceState:
    __slots__ = (
        "instance",
        "version",
        "target_version",
        "_trajs",
        "trajs",
        "waiting",
        "n_parked",
        "kv_tokens",
        "kv_capacity",
        "tokens_per_s",
        "syncing",
        "draining",
        "lane",
        "last_change",
        "snapshots_used",
        "snapshots_dropped",
    )

    def __init__(self, instance: int, kv_capacity: int, version: int = 0):
        _set(self, "instance", instance)
        _set(self, "version", version)
        """Weights loaded now."""
        _set(self, "target_version", version)
        """Post-sync version: the one it will run once its pending Pull completes (routing uses this)."""
        _set(self, "_trajs", {})
        _set(self, "trajs", MappingProxyType(self._trajs))
        """traj_id -> SchedRecord of what it holds (running + engine-waiting + parked), in routing order."""
        _set(self, "waiting", 0)
        _set(self, "n_parked", 0)
        """Held trajectories parked on a tool call (their records' ``parked``)."""
        _set(self, "kv_tokens", 0)
        _set(self, "kv_capacity", kv_capacity)
        _set(self, "tokens_per_s", 0.0)
        _set(self, "syncing", False)
        _set(self, "draining", False)
        """Waiting to pull without partial rollout: takes no new work until its trajectories finish."""
        _set(self, "lane", False)
        """A tail lane (coordinator/lanes.py): the routing pass routes nothing here, only the lane planner does."""
        _set(self, "last_change", float("-inf"))
        _set(self, "snapshots_used", 0)
        _set(self, "snapshots_dropped", 0)

    def __setattr__(self, name, value):
        raise AttributeError(
            f"InstanceState.{name} is read-only: the coordinator updates it (commands, snapshots); a strategy "
            f"returns commands instead (coordinator/strategies.py)"
        )

    @property
    def load(self) -> int:
        """Trajectories the instance holds (running + waiting + parked on a tool call)."""
        return len(self._trajs)

    @property
    def running(self) -> int:
        """Trajectories decoding (held, neither engine-waiting nor parked on a tool call)."""
        return max(0, self.engaged - self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv_tokens / self.kv_capacity

    @property
    def engaged(self) -> int:
        """Trajectories in the engine's batch or its queue (held, not parked on a tool call): a parked one
        decodes nothing until its call returns, a pull leaves it in place and migration never moves it."""
        return len(self._trajs) - self.n_parked

    @property
    def parked(self) -> frozenset[int]:
        """Ids of the held trajectories parked on a tool call."""
        return frozenset(t for t, r in self._trajs.items() if r.parked) if self.n_parked else frozenset()

    def indicator(self, kind: str) -> float:
        """Load indicator used by pull and migration rules: requests (held trajectories not parked on a
        tool call), kv (fraction, parked KV included: it is held) or throughput (tokens/s)."""
        if kind == "requests":
            return float(self.engaged)
        if kind == "kv":
            return self.kv_usage
        return self.tokens_per_s

    # ---- the coordinator's writes --------------------------------------------------------------
    def _hold(self, rec, now: float) -> None:
        """A record was routed here (the transition function): it brings ``rec.kv`` tokens."""
        self._trajs[rec.traj_id] = rec
        _set(self, "kv_tokens", self.kv_tokens + rec.kv)
        _set(self, "last_change", now)

    def _release(self, rec, now: float) -> None:
        """A held record left (finished, looped back, dropped): its tokens and parked mark go with it."""
        del self._trajs[rec.traj_id]
        _set(self, "kv_tokens", max(0, self.kv_tokens - rec.kv))
        if rec.parked:
            _set(self, "n_parked", self.n_parked - 1)
        _set(self, "waiting", min(self.waiting, self.engaged))
        _set(self, "last_change", now)

    def _parked_changed(self, rec) -> None:
        _set(self, "n_parked", self.n_parked + (1 if rec.parked else -1))

    def _start_pull(self, version: int, now: float) -> None:
        """A Pull was sent: it syncs to ``version`` (routing sees the post-sync version at once)."""
        _set(self, "syncing", True)
        _set(self, "draining", False)
        _set(self, "target_version", version)
        _set(self, "last_change", now)

    def _drain(self) -> None:
        _set(self, "draining", True)

    def _set_lane(self, lane: bool) -> None:
        _set(self, "lane", lane)

    def _pulled(self, version: int, now: float) -> None:
        _set(self, "version", version)
        _set(self, "target_version", version)
        _set(self, "syncing", False)
        _set(self, "last_change", now)

    def _touch(self, now: float) -> None:
        _set(self, "last_change", now)

    def accept(self, snap: InstanceSnapshot) -> bool:
        """Take a snapshot if it is not older than the last local change and agrees on the count
        (running + waiting + parked on a tool call). Its parked ids are the coordinator's to apply
        (record transitions PARK / UNPARK)."""
        if snap.time < self.last_change or snap.running + snap.waiting + len(snap.parked_ids) != len(self._trajs):
            _set(self, "snapshots_dropped", self.snapshots_dropped + 1)
            return False
        _set(self, "version", snap.version)
        if not snap.syncing and not self.syncing:
            _set(self, "target_version", max(self.target_version, snap.version))
        _set(self, "waiting", snap.waiting)
        _set(self, "kv_tokens", snap.kv_tokens)
        _set(self, "kv_capacity", snap.kv_capacity)
        _set(self, "tokens_per_s", snap.tokens_per_s)
        _set(self, "snapshots_used", self.snapshots_used + 1)
        return True
