"""verl fully-async's admission and batch rule as a batch protocol (``verl-fully-async``), pure Python.

Peer: volcengine/verl, ``verl/experimental/fully_async_policy/fully_async_rollouter.py``
(``FullyAsyncRollouter.set_max_required_samples``, ``_processor_worker``,
``_should_pause_generation``, ``update_param_version``) and ``fully_async_trainer.py``
(``_get_samples_from_queue``); docs/baselines.md has the paragraph and the deviations.

Units are prompt groups ("samples"). One training step takes B groups (require_batches x
ppo_mini_batch_size = B) and the weights are synchronised every T steps (verl's
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

from staleflow.protocol.counted import CountedBuffer
from staleflow.protocol.types import ProtocolError, StalenessSpec


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
