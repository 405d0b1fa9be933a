"""Stuck-buffer stragglers (coordinator ``straggler`` abort / truncate): the coordinator's tick calls
``handle_stragglers(coordinator, now, cmds)`` when the mode handles them."""

from __future__ import annotations

from staleflow.coordinator.types import Command, Interrupt


def handle_stragglers(coord, now: float, cmds: list[Command]) -> None:
    """Abort (and retry) or truncate the last stragglers of a Stuck buffer, ONCE per buffer.

    The retried groups reserve into the same window again; acting on them too would abort
    every retry as soon as it is dispatched (a livelock the simulator's property test found
    with eta 0 and no redundancy)."""
    if coord.straggler == "off" or coord.manager.version in coord._straggled_buffers:
        return
    gids = coord.manager.stuck_stragglers(coord.straggler_threshold)
    if gids:
        coord._straggled_buffers.add(coord.manager.version)
    for gid in gids:
        if gid in coord._stragglers_done:
            continue
        coord._stragglers_done.add(gid)
        coord.counters["stragglers"] += 1
        if coord.straggler == "abort":
            coord.abort_group(gid, "straggler", now, out=cmds, retry=True)
            continue
        live = sorted(coord.members.get(gid, ()))
        by_inst: dict[int, list[int]] = {}
        for t in live:
            by_inst.setdefault(coord.instance_of(t), []).append(t)
            coord.queue.remove(t)  # a queued one's partial is final too
        for i, ids in sorted(by_inst.items()):
            cmds.append(Interrupt(i, tuple(ids), "truncate"))
