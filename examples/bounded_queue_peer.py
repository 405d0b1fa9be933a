"""A peer baseline in one file: the bounded rollout queue, the plain asynchronous pipeline.

Many asynchronous RL systems start as a producer-consumer pipeline: the rollout side keeps at most K
prompt groups started and not yet trained (a bounded queue between rollout and training), the trainer
takes the first B groups that completed, and nothing bounds one trajectory's staleness except K: a
group may wait behind up to K - B others, so with K = (eta + 1) B it is trained at most about eta
versions after its start, and often later when its responses are long. Every weight update is pulled
by each instance as soon as it exists (its in-flight work is interrupted and resumed, re-prefilled),
routing is least-loaded over a FIFO queue, and nothing migrates.

The question such a fork answers: how does StaleFlow compare with the simplest asynchronous design
held to the same observed worst-case staleness? The file holds everything a peer is (staleflow.modes):
its batch rule (a CountedBuffer subclass: admission by the open-group count, batches in completion
order), its settings, its knob-search family for the simulator's grid, and its mode. Named by import
path, it runs in the simulator, in the grid's guarantee-matched peer search and in a real run:

    PYTHONPATH=$PWD ./launch.sh --preset tiny --mode examples.bounded_queue_peer:BoundedQueue
    PYTHONPATH=$PWD python -m staleflow sim --preset cpu-small --no-ablation \
        --modes verl-sync staleflow examples.bounded_queue_peer:BoundedQueue

(a fork's mode takes its settings' defaults; a built-in peer file registered in staleflow/modes/__init__.py
also gets the flags --peer.<mode>.<knob>).
"""

from __future__ import annotations

from dataclasses import dataclass

from examples.calls import record
from staleflow.modes import Mode, PeerConfig
from staleflow.protocol import CountedBuffer, ProtocolError


class BoundedQueueBuffer(CountedBuffer):
    """Admit a new group iff fewer than ``max_groups`` are open (started and not yet consumed); batches are
    the first B completed groups (completion order). A dropped group frees its place at once.

    >>> from staleflow.protocol import StalenessSpec
    >>> BoundedQueueBuffer(StalenessSpec(eta=1, batch_size=2), max_groups=4).max_groups
    4
    """

    def __init__(self, spec, max_groups: int | None = None, strict: bool = False):
        super().__init__(spec, strict)
        self.max_groups = (spec.eta + 1) * spec.batch_size if max_groups is None else max_groups
        if type(self.max_groups) is not int or self.max_groups < spec.batch_size:
            raise ProtocolError(
                f"BoundedQueueBuffer max_groups={max_groups!r} must be an int >= B={spec.batch_size} (a batch must fit)"
            )
        self.open = 0
        """Groups started and not yet consumed (in flight, or completed and waiting for the trainer)."""

    def _room(self, traj_version: int) -> bool:
        return self.open < self.max_groups

    def _admitted(self, g) -> None:
        record("BoundedQueueBuffer.admit")
        self.open += 1

    def _left(self, g, completed: bool) -> None:
        if not completed:  # dropped: its place is free again (a completed one holds it until trained)
            self.open -= 1

    def _unqueued(self, g) -> None:
        self.open -= 1  # the strict variant dropped a completed, over-stale group

    def _batch(self, queue: list) -> list:
        return queue[: self.batch_size]

    def consume(self, v: int) -> list:
        batch = super().consume(v)
        self.open -= len(batch)
        return batch

    def _counters(self) -> dict:
        return {"open": self.open, "max_groups": self.max_groups}


@dataclass(frozen=True)
class BoundedQueueSettings:
    """The peer's own knobs."""

    max_groups: int = 0
    """K: groups started and not yet trained, at most (0: (eta + 1) x B)."""
    strict: bool = False
    """Drop and regenerate a group that can no longer be trained within eta (the grid's strict column)."""


class BoundedQueue(Mode):
    """The mode: the rule above, least-loaded routing over a FIFO queue, greedy pulls with partial rollout."""

    peer = "bounded-queue"
    coordinator = {
        "routing": "least-loaded",
        "pull": "greedy",
        "mlq": False,
        "migration": False,
        "barrier": False,
        "interrupt_on_pull": True,
        "keep_kv_on_pull": False,
        "tail_lanes": False,
    }
    staleness = {"batch_redundancy": 0, "group_redundancy": 0, "straggler": "off"}
    weight_sync = "broadcast"
    Settings = BoundedQueueSettings

    def protocol(self, spec, settings, n_instances, train_order):
        return BoundedQueueBuffer(spec, settings.max_groups or None, settings.strict)

    def families(self, batch_size):
        """K = B, 2 B, ... 5 B: the worst case grows with K, so the search stops at the first K beyond eta."""
        return [[self.config(k, batch_size) for k in range(1, 6)]]

    def nominal(self, eta, batch_size):
        return [self.config(eta + 1, batch_size)]

    def strict(self, eta, batch_size):
        return [self.config(eta + 1, batch_size, strict=True)]

    def config(self, k: int, batch_size: int, strict: bool = False) -> PeerConfig:
        """K = k B (nominal eta k - 1)."""
        knobs = (("max_groups", k * batch_size),) + ((("strict", True),) if strict else ())
        return PeerConfig(self.name, k - 1, knobs, (), f"bounded-queue K={k}B" + (" strict" if strict else ""))
