"""The AReaL peer (``areal``): its admission and batch rule, its knobs and their search, one file.

Peer: inclusionAI/AReaL, ``areal/infra/staleness_manager.py`` (``StalenessManager.get_capacity``)
and ``areal/infra/workflow_executor.py`` (``BatchTaskDispatcher.wait_results``,
``WorkflowExecutor.prepare_batch``); docs/baselines.md has the paragraph and the deviations.
Mode: AReaL ``StalenessManager.get_capacity`` admission, batches of the earliest-started completed groups,
round-robin routing, pause-all + broadcast update with abort and same-server resume.

Admission: a new prompt group may start iff
    running < max_concurrent_rollouts  and  accepted + running < (eta + v + 1) * B
where v is the version the rollout instances run (``on_rollout_version``), ``accepted`` counts
completed groups since the start (never decremented when the trainer consumes them) and
``running`` counts started, unfinished groups; a dropped (rejected) group frees its slot.
Batches: the B completed groups that STARTED earliest among those completed so far (AReaL sorts
the drained results by ``create_time`` and puts the rest back). Staleness is not bounded per
trajectory: ``over_eta()`` counts the trained groups that exceeded eta.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.modes.base import Mode, PeerConfig, check, register_mode
from staleflow.modes.staleflow import NO_REDUNDANCY
from staleflow.modes.verl import PAUSE_ALL
from staleflow.protocol.counted import CountedBuffer
from staleflow.protocol.types import ProtocolError, StalenessSpec

AREAL_ETAS = (0, 1, 2, 3, 4, 5)
"""max_head_offpolicyness values of the search (each concurrency cap's family scans them in order)."""


@dataclass(frozen=True)
class AReaLSettings:
    """--mode areal's own knobs (--peer.areal.<knob>)."""

    max_concurrent_rollouts: int = 0
    """AReaL's max_concurrent_rollouts, in groups (0: (eta + 1) x B, which never binds)."""
    strict: bool = False
    """Drop and regenerate a group that can no longer be trained within eta (the grid's strict variant;
    not the peer's own behaviour)."""

    def __post_init__(self):
        check(
            self.max_concurrent_rollouts >= 0,
            "peer.areal.max-concurrent-rollouts",
            self.max_concurrent_rollouts,
            "must be >= 0 (0: (eta + 1) x B)",
        )


@register_mode("areal")
class AReaL(Mode):
    peer = "areal"
    coordinator = {**PAUSE_ALL, "migration": False}
    staleness = dict(NO_REDUNDANCY)
    weight_sync = "broadcast"
    Settings = AReaLSettings

    def protocol(self, spec, settings, n_instances, train_order):
        cap = settings.max_concurrent_rollouts or None
        return AReaLBuffer(spec, max_concurrent=cap, strict=settings.strict)

    def families(self, batch_size):
        """max_head_offpolicyness 0, 1, 2, ... for each concurrency cap: B (AReaL's default), 2 B and (eta + 1) B
        (never binds); a cap above (eta + 1) B is the same as (eta + 1) B, so each (eta, cap) pair appears once."""
        B = batch_size
        return [
            [config(e, B, B) for e in AREAL_ETAS],
            [config(e, 2 * B, B) for e in AREAL_ETAS if e >= 1],
            [config(e, (e + 1) * B, B) for e in AREAL_ETAS if e >= 2],
        ]

    def nominal(self, eta, batch_size):
        return [config(eta, (eta + 1) * batch_size, batch_size)]

    def strict(self, eta, batch_size):
        return [config(eta, (eta + 1) * batch_size, batch_size, strict=True)]


def config(eta: int, cap: int, batch_size: int, strict: bool = False) -> PeerConfig:
    """One AReaL configuration of the search: max_head_offpolicyness eta, max_concurrent_rollouts cap."""
    peer = [("max_concurrent_rollouts", cap)] + ([("strict", True)] if strict else [])
    cap_s = "B" if cap == batch_size else f"{cap // batch_size}B" if cap % batch_size == 0 else str(cap)
    return PeerConfig("areal", eta, tuple(peer), (), f"areal eta={eta} cap={cap_s}" + (" strict" if strict else ""))


class AReaLBuffer(CountedBuffer):
    """m = AReaLBuffer(StalenessSpec(eta=1, batch_size=2)); m.can_admit(0)  # True until 2 * 2 groups are started"""

    def __init__(self, spec: StalenessSpec, max_concurrent: int | None = None, strict: bool = False):
        super().__init__(spec, strict)
        eta, batch_size, version = spec.eta, spec.batch_size, spec.version
        # AReaL's default (None) is consumer_batch_size; its long-CoT example (boba) uses 2 B. We default to
        # (eta + 1) B, which never binds below the staleness formula; the grid searches B, 2 B and (eta + 1) B.
        self.max_concurrent = (eta + 1) * batch_size if max_concurrent is None else max_concurrent
        if type(self.max_concurrent) is not int or self.max_concurrent < 1:
            raise ProtocolError(f"AReaLBuffer max_concurrent={max_concurrent!r} must be an int >= 1")
        self.accepted = version * batch_size  # AReaL's on_version_recovered(v) after a resume
        self.running = 0

    def _room(self, traj_version: int) -> bool:
        limit = (self.eta + self.rollout_version + 1) * self.batch_size
        return self.running < self.max_concurrent and self.accepted + self.running < limit

    def _admitted(self, g) -> None:
        self.running += 1

    def _left(self, g, completed: bool) -> None:
        self.running -= 1
        self.accepted += completed

    def _unqueued(self, g) -> None:
        self.accepted -= 1  # strict variant: a dropped over-stale group is a rejection (AReaL does not count those)

    def _batch(self, queue: list) -> list:
        return sorted(queue, key=self._seq.__getitem__)[: self.batch_size]

    def _counters(self) -> dict:
        return {"accepted": self.accepted, "running": self.running, "max_concurrent": self.max_concurrent}

    def validate(self) -> None:
        super().validate()
        running = sum(1 for g in self._groups.values() if not g.occupied)
        if running != self.running or self.running > self.max_concurrent:
            raise ProtocolError(
                f"AReaLBuffer running={self.running} but {running} groups are in flight (cap {self.max_concurrent})"
            )
