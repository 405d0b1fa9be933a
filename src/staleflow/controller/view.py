"""What a front end may read of a running controller loop: a read-only view.

The runtime's training job drives the loop with ``ControllerLoop.run`` and hears from it through
events (the step record, its own listeners); for checkpoints, metrics and its wait conditions it
reads this view, never the loop's tables.

    view = loop.view
    loop.run(until=lambda: not view.syncing, timeout_s=900, pull=view.version)
"""

from __future__ import annotations


class LoopView:
    __slots__ = ("_loop",)

    def __init__(self, loop):
        self._loop = loop

    @property
    def version(self) -> int:
        """The trainer's version: the next buffer it trains (= the newest model)."""
        return self._loop.version

    @property
    def done(self) -> bool:
        """--steps versions are published and no step is running."""
        return self._loop.done

    @property
    def training(self) -> bool:
        """A training step is running."""
        return self._loop.training is not None

    @property
    def syncing(self) -> bool:
        """Some instance is still loading weights."""
        return any(i.syncing for i in self._loop.coord.instances.values())

    @property
    def tokens_generated(self) -> int:
        """Tokens the instances generated so far (their newest snapshots)."""
        return sum(self._loop.tokens_generated.values())

    @property
    def first_reward_error(self) -> str:
        return self._loop.first_reward_error

    def counts(self) -> dict:
        """The loop's counters (routes, interrupts, pulls, aborts by reason...), a copy."""
        return dict(self._loop.counts)

    def ids(self) -> tuple[int, int]:
        """(next trajectory id, next group id): ids are never reused, also across a resume."""
        led = self._loop.ledger
        return led.next_traj, led.next_group

    def live_prompts(self) -> list:
        """Prompts of the groups not yet trained (a resume generates them again)."""
        return self._loop.ledger.state_dict()["live_prompts"]
