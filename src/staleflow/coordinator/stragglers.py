"""Stuck-buffer stragglers (``--staleness.straggler abort | truncate``) as a planner: the coordinator runs
it each tick when the run handles stragglers, and applies the commands it returns."""

from __future__ import annotations

from collections.abc import Iterator

from staleflow.coordinator.types import Abort, Command, Interrupt


class Stragglers:
    """Abort (and retry) or truncate the last stragglers of a Stuck buffer, ONCE per buffer.

    The retried groups reserve into the same window again; acting on them too would abort
    every retry as soon as it is dispatched (a livelock the simulator's property test found
    with eta 0 and no redundancy). abort: ``Abort(-1, (), "straggler", retry=True, group_id)``;
    truncate: ``Interrupt(instance, ids, "truncate")`` per instance holding the group's members
    (instance -1: the queued ones, whose partial is final as it is)."""

    def __init__(self, how: str, threshold: int):
        self.how, self.threshold = how, threshold
        self.done: set[int] = set()
        """Groups already handled (group ids are never reused)."""
        self.buffers: set[int] = set()
        """Buffer versions whose stragglers were handled."""

    def plan(self, ctx, now: float) -> Iterator[Command]:
        if ctx.buffer_version in self.buffers:
            return
        gids = ctx.stuck_stragglers(self.threshold)
        if gids:
            self.buffers.add(ctx.buffer_version)
            self.done = {g for g in self.done if ctx.group_live(g)}  # ended groups cannot be stragglers again
        for gid in gids:
            if gid in self.done:
                continue
            self.done.add(gid)
            if self.how == "abort":
                yield Abort(-1, (), "straggler", True, gid)
                continue
            by_inst: dict[int, list[int]] = {}
            for t in ctx.group_members(gid):
                by_inst.setdefault(ctx.record(t).instance, []).append(t)
            for i, ids in sorted(by_inst.items()):
                yield Interrupt(i, tuple(ids), "truncate")
