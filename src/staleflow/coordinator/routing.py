"""The coordinator's routing pass (step 6 of its tick) and the admission state it keeps between ticks.

The multi-level queue is served oldest V_traj level first (strict priority: a level with leftovers
stops the pass); each queued trajectory's candidates are the open instances (under the concurrency cap,
not draining, not a tail lane) at a post-sync version >= its V_traj (a fresh group's first member: any version where
the batch protocol has room; its V_traj becomes that instance's version). Without migration a
loop-back resumes on its origin; a migrated one avoids the instance it left unless nothing else can
run it. The routing strategy (coordinator/strategies.py) picks one candidate through the read-only
view; Reserve happens here, then the trajectory's record moves to the instance (its transition).
A trajectory whose (V_traj, tokens, excluded instance) just failed to place is skipped cheaply, and
a level gives up after --coordinator.scan-limit misses in a row (the tick's cost stays bounded).
"""

from __future__ import annotations

from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.record import ROUTE
from staleflow.coordinator.types import Command, TrajFacts
from staleflow.trajectory import Route


class RoutingPass:
    def __init__(self, coordinator):
        self.c = coordinator
        self.budget = 0
        """The batch barrier (verl's sync and one-step-off): new groups it may still admit in this batch."""
        self._admissible: set[int] | None = None  # post-sync versions where a new group may start (this pass)
        self._admit: dict[int, bool] = {}  # version -> can a new group start there (this tick)

    def new_tick(self) -> None:
        self._admit.clear()

    def routable_at(self, version: int) -> bool:
        """Could some queued trajectory be routed to an instance running `version`?"""
        c = self.c
        tagged = c.queue.tagged
        if any(v <= version for v, n in tagged.items() if n > 0):
            return True
        if len(c.queue) > sum(tagged.values()):
            if c.cfg.barrier and self.budget <= 0:
                return False
            ok = self._admit.get(version)
            if ok is None:
                ok = self._admit[version] = c.manager.can_admit(version)
            return ok
        return False

    def run(self, now: float, cmds: list[Command]) -> None:
        """Route queued trajectories, oldest V_traj level first (strict priority), each to the instance the
        routing strategy chooses among the candidates; a level stops after scan_limit misses in a row."""
        c = self.c
        cap = c.cfg.max_concurrent
        open_ = [i for i in c.instances.values() if len(i.trajs) < cap and not i.draining and not i.lane]
        if not open_ or not len(c.queue):
            return
        if (
            c.cfg.barrier
            and c.in_flight == 0
            and not any(i.syncing or i.target_version < c.ps_version for i in c.instances.values())
        ):
            self.budget = c.manager.capacity
        self._admissible = None
        records, trajs, tags, queue = c.sched.records, c.trajs, c.group_tag, c.queue  # (locals: the hot loop)
        migration, limit = c.cfg.migration, c.cfg.scan_limit
        failed: set[tuple] = set()  # (V_traj, tokens) that found no instance since the last route
        for key in queue.level_keys():
            fails, leftover = 0, False
            for t in queue.iter_level(key, queue.level_size(key)):
                if not open_ or fails >= limit:
                    leftover = True
                    break
                rec, srec = trajs[t], records[t]
                sig = (
                    rec.traj_version if rec.traj_version is not None else tags.get(rec.group_id),
                    rec.tokens,
                    srec.moved_off if migration else rec.origin,
                )
                if sig in failed:  # same placement problem as one that just failed: skip cheaply
                    fails, leftover = fails + 1, True
                    continue
                inst, V = self.place(rec, srec, open_, failed, sig)
                if inst is None:
                    fails, leftover = fails + 1, True
                    continue
                fails = 0
                failed.clear()
                self.route_one(rec, srec, inst, V, now, cmds)
                if len(inst.trajs) >= cap:
                    open_.remove(inst)
            if leftover and queue.enabled:
                break  # strict priority: newer levels wait for the older one

    def place(self, rec: TrajFacts, srec, open_: list[InstanceState], failed: set, sig: tuple):
        """Pick an instance for one queued trajectory (None if it must wait) and its V_traj."""
        c = self.c
        gid = rec.group_id
        V = sig[0]
        if V is None:  # the first member of a fresh group: dynamic tag = instance post-sync version
            if c.cfg.barrier and self.budget <= 0:
                failed.add(sig)
                return None, -1
            if self._admissible is None:
                self._admissible = {
                    v for v in {i.target_version for i in c.instances.values()} if c.manager.can_admit(v)
                }
            ok = self._admissible
            cands = [i for i in open_ if i.target_version in ok]
        else:
            if not srec.reserved and not c.manager.can_admit(V, gid):
                return None, -1
            if rec.origin >= 0 and not c.cfg.migration:  # no migration: resume where it ran
                cands = [i for i in open_ if i.instance == rec.origin and i.target_version >= V]
            else:  # a migrated trajectory does not go back to the instance it left, unless nothing else can run it
                cands = [i for i in open_ if i.target_version >= V]
                left = srec.moved_off
                cands = [i for i in cands if i.instance != left] or cands
        inst = c.router.choose(rec, V, cands, c.view) if cands else None
        if inst is None:
            failed.add(sig)
            return None, -1
        if (  # the choice must be a candidate (cheap checks: the hot path)
            c.instances.get(inst.instance) is not inst
            or inst.draining
            or len(inst.trajs) >= c.cfg.max_concurrent
            or (inst.target_version not in self._admissible if V is None else inst.target_version < V)
        ):
            raise ValueError(
                f"routing strategy {c.cfg.routing!r} chose instance {inst.instance}, not one of its candidates "
                f"{[i.instance for i in cands]} for trajectory {rec.traj_id}"
            )
        return inst, (inst.target_version if V is None else V)

    def route_one(self, rec: TrajFacts, srec, inst: InstanceState, V: int, now: float, cmds: list[Command]) -> None:
        """Route one trajectory: reserve first (a new group's first member fixes its V_traj), then the record."""
        c = self.c
        t, gid = rec.traj_id, rec.group_id
        if not srec.reserved:
            if gid not in c.group_tag:
                c.group_tag[gid] = V
                if c.cfg.barrier:
                    self.budget -= 1
            c.manager.reserve(t, gid, V)
            self._admit.clear()
            self._admissible = None
        c.sched.transition(t, ROUTE, instance=inst.instance, kv=rec.tokens, now=now)
        cmds.append(Route(t, inst.instance, V))
        c.counters["routes"] += 1
