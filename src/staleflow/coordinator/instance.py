"""The coordinator's speculative view of one rollout instance (paper section 6.1).

Updated at once by the coordinator's own commands (a Route adds a trajectory and its KV tokens,
a finish or interrupt removes them) and overwritten by a snapshot only when the snapshot is
newer than the last local change and agrees with the locally tracked trajectory count, so the
coordinator never acts on outdated information. The snapshot also names the trajectories parked on a tool
call (``parked``): they hold the instance (and maybe KV) but do not decode, so a pull leaves them in place and
migration never moves them.
"""

from __future__ import annotations

from staleflow.coordinator.types import InstanceSnapshot


class InstanceState:
    __slots__ = (
        "instance",
        "version",
        "target_version",
        "trajs",
        "waiting",
        "parked",
        "kv_tokens",
        "kv_capacity",
        "tokens_per_s",
        "syncing",
        "draining",
        "last_change",
        "snapshots_used",
        "snapshots_dropped",
    )

    def __init__(self, instance: int, kv_capacity: int, version: int = 0):
        self.instance = instance
        self.version = version
        """Weights loaded now."""
        self.target_version = version
        """Post-sync version: the one it will run once its pending Pull completes (routing uses this)."""
        self.trajs: dict[int, int] = {}
        """traj_id -> KV tokens it brought when routed (running + engine-waiting + parked), in routing order."""
        self.waiting = 0
        self.parked: set[int] = set()
        """Held trajectories parked on a tool call (the last accepted snapshot's, minus those gone since)."""
        self.kv_tokens = 0
        self.kv_capacity = kv_capacity
        self.tokens_per_s = 0.0
        self.syncing = False
        self.draining = False
        """Waiting to pull without partial rollout: takes no new work until its trajectories finish."""
        self.last_change = float("-inf")
        self.snapshots_used = 0
        self.snapshots_dropped = 0

    @property
    def load(self) -> int:
        """Trajectories the instance holds (running + waiting + parked on a tool call)."""
        return len(self.trajs)

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
        return len(self.trajs) - len(self.parked)

    def indicator(self, kind: str) -> float:
        """Load indicator used by pull and migration rules: requests (held trajectories not parked on a
        tool call), kv (fraction, parked KV included: it is held) or throughput (tokens/s)."""
        if kind == "requests":
            return float(self.engaged)
        if kind == "kv":
            return self.kv_usage
        return self.tokens_per_s

    def add(self, traj_id: int, tokens: int, now: float) -> None:
        self.trajs[traj_id] = tokens
        self.kv_tokens += tokens
        self.last_change = now

    def remove(self, traj_id: int, now: float) -> bool:
        tokens = self.trajs.pop(traj_id, None)
        if tokens is None:
            return False
        self.kv_tokens = max(0, self.kv_tokens - tokens)
        self.parked.discard(traj_id)
        self.waiting = min(self.waiting, self.engaged)
        self.last_change = now
        return True

    def accept(self, snap: InstanceSnapshot) -> bool:
        """Take a snapshot if it is not older than the last local change and agrees on the count
        (running + waiting + parked on a tool call)."""
        if snap.time < self.last_change or snap.running + snap.waiting + len(snap.parked_ids) != len(self.trajs):
            self.snapshots_dropped += 1
            return False
        self.version = snap.version
        if not snap.syncing and not self.syncing:
            self.target_version = max(self.target_version, snap.version)
        self.waiting = snap.waiting
        self.parked = {t for t in snap.parked_ids if t in self.trajs}
        self.kv_tokens = snap.kv_tokens
        self.kv_capacity = snap.kv_capacity
        self.tokens_per_s = snap.tokens_per_s
        self.snapshots_used += 1
        return True
