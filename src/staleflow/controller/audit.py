"""The controller loop's audit of the batch protocol, from outside it: the V_traj every route
carries, the bound of every trained group, every fate exactly once. A protocol without a
per-trajectory bound (``bounded`` False: the peers) has groups beyond eta counted, not flagged."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Audit:
    violations: list[str] = field(default_factory=list)
    bound_violations: int = 0
    over_eta: int = 0
    """Trained groups with staleness > eta under a protocol that does not bound it (the peers)."""
    group_tag: dict[int, int] = field(default_factory=dict)
    """group id -> the V_traj its first route carried (every later route must carry the same)."""

    def route(self, group_id: int, traj_id: int, was: int | None, V: int) -> None:
        """A route of trajectory `traj_id` (V_traj `was` at its previous route, None if first) with V."""
        tag = self.group_tag.setdefault(group_id, V)
        if tag != V:
            self.violations.append(f"group {group_id} routed with V_traj {V} after {tag}")
        if was is not None and was != V:
            self.violations.append(f"trajectory {traj_id} re-routed with V_traj {V} (was {was})")

    def trained(self, group_id: int, V: int, v: int, eta: int, bounded: bool, complete: bool, n: int) -> None:
        """Group `group_id` (V_traj V, `n` members, all rewarded if `complete`) is trained in buffer v."""
        self.group_tag.pop(group_id, None)
        if not complete:
            self.violations.append(f"group {group_id} consumed with {n} rewarded members")
        if V <= v and v > V + eta and not bounded:
            self.over_eta += 1
        elif not V <= v <= V + eta:
            self.bound_violations += 1
            self.violations.append(f"group {group_id} V_traj {V} consumed in buffer {v} (eta {eta})")

    def aborted(self, traj_id: int, fate: str | None) -> None:
        """An Abort names a trajectory whose fate so far is `fate` (None: still live)."""
        if fate == "consumed":
            self.violations.append(f"abort of trajectory {traj_id}, which was already trained")
