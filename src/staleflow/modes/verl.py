"""The verl peers: ``verl-sync``, ``verl-one-step-off`` and ``verl-fully-async`` (its count-based batch rule,
its knobs and their search), one file.

- ``verl-sync`` (alias ``sync``): veRL ``RayPPOTrainer.fit``; colocated, generate a batch of B groups
  (round-robin), train, update in place; eta 0.
- ``verl-one-step-off`` (alias ``one-step-off``): veRL ``OneStepOffRayTrainer.fit``; batch k+1 is
  generated with the weights before step k while step k trains; sync (broadcast) at batch boundaries.
- ``verl-fully-async``: veRL ``FullyAsyncRollouter`` / ``FullyAsyncTrainer``; streaming admission by
  the ``staleness_threshold`` window counter (s = eta, trigger_parameter_sync_step = 1), batches in
  completion order, every sync interrupts all in-flight work (partial rollout) and resumes it anywhere.

verl fully-async's rule. Peer: volcengine/verl, ``verl/experimental/fully_async_policy/fully_async_rollouter.py``
(``FullyAsyncRollouter.set_max_required_samples``, ``_processor_worker``, ``_should_pause_generation``,
``update_param_version``) and ``fully_async_trainer.py`` (``_get_samples_from_queue``); docs/baselines.md has
the paragraph and the deviations. Units are prompt groups ("samples"). One training step takes B groups
(require_batches x ppo_mini_batch_size = B) and the weights are synchronised every T steps (verl's
trigger_parameter_sync_step; the rollout's version then jumps by T), so
    max_required = int(B * (1 + s) * T),  max_queue = max_required,
    max_concurrent = min(16 * rollout replicas, max_required).
A new group starts iff the message queue holds < max_queue groups, the window counter
``staleness_samples`` < max_required and fewer than max_concurrent groups are active; each start
adds 1 to the counter. When every instance runs a new version the counter restarts from the
carry-over: active (including interrupted, re-queued) groups + groups waiting in the queue.
Batches: the first B groups in completion order (the message queue is FIFO). Interrupted work
resumes without counting (verl's cancel queue). No per-trajectory bound: ``over_eta()`` counts
trained groups beyond eta.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.modes.base import Mode, PeerConfig, check, nominal_eta, register_mode
from staleflow.modes.staleflow import NO_REDUNDANCY
from staleflow.protocol.counted import CountedBuffer
from staleflow.protocol.types import ProtocolError, StalenessSpec

BARRIER = {
    "routing": "round-robin",
    "pull": "idle",
    "migration": False,
    "mlq": False,
    "barrier": True,
    "interrupt_on_pull": False,
    "keep_kv_on_pull": False,
    "tail_lanes": False,
}
"""verl's synchronous trainers: a batch of B groups at a time, weights at the batch boundary."""
PAUSE_ALL = {
    "routing": "round-robin",
    "pull": "pause-all",
    "mlq": False,
    "barrier": False,
    "interrupt_on_pull": True,
    "keep_kv_on_pull": False,
    "tail_lanes": False,
}
"""One global update per version. The peers clear the KV cache at every weight update (verl clear_kv_cache, AReaL
pause_generation with clear_cache): interrupted work re-prefills, nothing keeps its KV across a load."""
NEVER_MIGRATE = {"phi_wait": 1 << 30, "psi": 0.0}
"""Migration triggers that never fire (psi 0: the throughput-gap trigger is off; finite, so the run's
config checks accept it): loop-backs may go to any instance, nothing is moved actively."""
S_GRID = {
    1: (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0),
    2: (0.0, 0.1, 0.25, 0.5, 0.75, 1.0),
    3: (0.0, 0.1, 0.25, 0.5),
    4: (0.0, 0.1, 0.25),
}
"""verl staleness_threshold values per trigger_parameter_sync_step T (scanned in this order)."""
S_NO_PARTIAL = (0.5, 1.0, 2.0, 3.0)
"""partial_rollout=False (T = 1): every sync waits for all in-flight work, so s barely moves throughput."""


@register_mode("verl-sync")
class VerlSync(Mode):
    peer = "verl"
    aliases = ("sync",)
    coordinator = dict(BARRIER)
    staleness = {"eta": 0, **NO_REDUNDANCY}
    weight_sync = "colocated"
    colocated = True
    fixed_eta = 0

    def reduced_families(self, max_eta):
        return self.families(0)  # the synchronous baseline is in every search


@register_mode("verl-one-step-off")
class VerlOneStepOff(Mode):
    peer = "verl"
    aliases = ("one-step-off",)
    coordinator = dict(BARRIER)
    staleness = {"eta": 1, **NO_REDUNDANCY}
    weight_sync = "broadcast"
    fixed_eta = 1


@dataclass(frozen=True)
class VerlSettings:
    """--mode verl-fully-async's own knobs (--peer.verl-fully-async.<knob>)."""

    staleness_threshold: float | None = None
    """verl's staleness_threshold s (a fraction is allowed): a sync window admits (1 + s) x T x B groups.
    Unset: s = eta (matched to StaleFlow's eta + 1 buffers)."""
    trigger_sync_steps: int = 1
    """verl's trigger_parameter_sync_step T: the rollout side takes new weights every T steps (the
    coordinator pulls only versions that are multiples of T). s = 0 with T = eta + 1 keeps every group
    within eta (the grid's guarantee-matched peer)."""
    strict: bool = False
    """Drop and regenerate a group that can no longer be trained within eta (the grid's strict variant;
    not the peer's own behaviour)."""

    def __post_init__(self):
        flag = "peer.verl-fully-async."
        s = self.staleness_threshold
        check(s is None or s >= 0, flag + "staleness-threshold", s, "must be >= 0 (or unset: eta)")
        check(self.trigger_sync_steps >= 1, flag + "trigger-sync-steps", self.trigger_sync_steps, "must be >= 1")


@register_mode("verl-fully-async")
class VerlFullyAsync(Mode):
    peer = "verl"
    coordinator = {**PAUSE_ALL, "migration": True, **NEVER_MIGRATE}
    staleness = dict(NO_REDUNDANCY)
    weight_sync = "broadcast"
    Settings = VerlSettings

    def protocol(self, spec, settings, n_instances, train_order):
        """s = eta unless set: with one version per B groups the window admits (1 + s) B groups ahead of the
        trainer, the (eta + 1) B that AReaL's formula and StaleFlow's eta + 1 buffers allow (matched eta)."""
        s = float(spec.eta) if settings.staleness_threshold is None else settings.staleness_threshold
        return VerlAsyncBuffer(spec, s, n_instances, settings.trigger_sync_steps, settings.strict)

    def publish_every(self, settings) -> int:
        return settings.trigger_sync_steps

    def families(self, batch_size):
        """T in 1..4 with s on a fine grid (nominal eta ceil((1 + s) T) - 1), then partial_rollout=False."""
        out = [[config(s, T) for s in S_GRID[T]] for T in sorted(S_GRID)]
        out.append([config(s, 1, partial=False) for s in S_NO_PARTIAL])
        return out

    def reduced_families(self, max_eta):
        return [[config(0.0, T) for T in range(1, max_eta + 2)]]

    def nominal(self, eta, batch_size):
        return [config(float(eta))]

    def strict(self, eta, batch_size):
        return [config(float(eta), strict=True)]


def config(s: float, T: int = 1, partial: bool = True, strict: bool = False) -> PeerConfig:
    """One verl fully-async configuration of the search: staleness_threshold s, trigger_parameter_sync_step T,
    partial_rollout (False: a sync waits for every in-flight trajectory), the strict variant."""
    peer = [("staleness_threshold", float(s))]
    if T != 1:
        peer.append(("trigger_sync_steps", T))
    if strict:
        peer.append(("strict", True))
    eta = int(s) if strict else nominal_eta(s, T)
    label = (
        f"verl-fully-async s={s:g}"
        + (f" T={T}" if T != 1 else "")
        + ("" if partial else " no-partial")
        + (" strict" if strict else "")
    )
    return PeerConfig("verl-fully-async", eta, tuple(peer), () if partial else (("interrupt_on_pull", False),), label)


class VerlAsyncBuffer(CountedBuffer):
    """m = VerlAsyncBuffer(StalenessSpec(eta=1, batch_size=4), staleness_threshold=0.5)  # 6 groups per version window"""

    def __init__(
        self,
        spec: StalenessSpec,
        staleness_threshold: float | None = None,
        n_instances: int = 1,
        trigger_sync_steps: int = 1,
        strict: bool = False,
    ):
        super().__init__(spec, strict)
        eta, batch_size = spec.eta, spec.batch_size
        s = float(eta) if staleness_threshold is None else staleness_threshold
        if not isinstance(s, (int, float)) or s < 0:
            raise ProtocolError(f"VerlAsyncBuffer staleness_threshold={staleness_threshold!r} must be >= 0")
        if type(n_instances) is not int or n_instances < 1:
            raise ProtocolError(f"VerlAsyncBuffer n_instances={n_instances!r} must be an int >= 1")
        if type(trigger_sync_steps) is not int or trigger_sync_steps < 1:
            raise ProtocolError(f"VerlAsyncBuffer trigger_sync_steps={trigger_sync_steps!r} must be an int >= 1")
        self.staleness_threshold = s
        self.trigger_sync_steps = trigger_sync_steps
        self.max_required = int(batch_size * (1 + s) * trigger_sync_steps)
        self.max_queue = self.max_required
        self.max_concurrent = min(16 * n_instances, self.max_required)
        self.staleness_samples = 0
        self.active = 0

    def _room(self, traj_version: int) -> bool:
        return (
            len(self._queue) < self.max_queue
            and self.staleness_samples < self.max_required
            and self.active < self.max_concurrent
        )

    def _admitted(self, g) -> None:
        self.staleness_samples += 1
        self.active += 1

    def _left(self, g, completed: bool) -> None:
        self.active -= 1

    def on_rollout_version(self, version: int) -> None:
        if version > self.rollout_version:  # update_param_version: the window counter carries over
            self.rollout_version = version
            self.staleness_samples = self.active + len(self._queue)

    def _batch(self, queue: list) -> list:
        return queue[: self.batch_size]

    def _counters(self) -> dict:
        return {
            "staleness_samples": self.staleness_samples,
            "active": self.active,
            "max_required": self.max_required,
            "max_concurrent": self.max_concurrent,
        }

    def validate(self) -> None:
        super().validate()
        active = sum(1 for g in self._groups.values() if not g.occupied)
        if active != self.active or self.active + len(self._queue) > self.max_required:
            raise ProtocolError(
                f"VerlAsyncBuffer active={self.active} ({active} in flight) + queued "
                f"{len(self._queue)} exceeds max_required={self.max_required}"
            )
