"""The staleness-aware coordinator: the Snapshot-Command cycle (paper section 6).

Pure logic shared by the real controller and the simulator: no torch, no sockets, and an
injectable clock. The runtime (or simulator) feeds events and calls ``tick(now)`` about every
10 ms; each tick returns the commands to execute, in order:

    1. aborts decided since the last tick (group redundancy surplus, failures),
    2. closed windows (groups that can no longer be placed) and stuck-buffer stragglers,
    3. Pull decisions (each preceded by an Interrupt of the instance's in-flight work, tool waiters excepted),
    4. at most one migration (never while an instance syncs),
    5. the routing pass over the multi-level queue (paused while interrupted work has not
       looped back yet, so the queue order stays right).

Reserve happens at Route time with a dynamic version tag: the first member of a prompt group
routed to an instance fixes the group's V_traj to that instance's post-sync version; later
members and every loop-back keep it. Candidates always have post-sync version >= V_traj.

Runtime contract (staleflow.controller.loop drives it, in the runtime and the simulator alike):
``submit`` new trajectories (ids); report ``on_snapshot``, ``on_finished`` (False: the trajectory
was already dropped, e.g. as group-redundancy surplus), ``on_rewarded`` once the group's N finished
members are rewarded (Occupy), ``on_interrupted`` (partial outputs came back), ``on_pull_done``,
``on_new_version`` (the PS published v), ``on_failed``. The trainer side uses the manager directly
(``ready_version`` / ``consume``). The config arrives with its mode already applied (config.resolve).
Per trajectory it keeps ids only; the facts it acts on (group, V_traj, prompt length, tokens
generated, origin) it looks up by id in ``trajs``, the ledger's table (``TrajFacts``), read-only.

With migration off (``--coordinator.migration false``) a loop-back resumes on the instance it
was interrupted on (its ``origin``), never elsewhere. The batch protocol (``manager``) is the one
the mode names (coordinator/modes.py): StaleFlow's StalenessManager or a peer's count-based rule.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.mlq import MultiLevelQueue
from staleflow.coordinator.modes import check_protocol
from staleflow.coordinator.pull import plan_pulls, updating
from staleflow.coordinator.stragglers import handle_stragglers
from staleflow.coordinator.strategies import make_pull, make_routing, migrate
from staleflow.coordinator.types import Abort, Command, InstanceSnapshot, TrajFacts
from staleflow.trajectory import Route

_INSTANCE_STATS = ("version", "load", "syncing", "snapshots_used", "snapshots_dropped")


class Coordinator:
    def __init__(
        self,
        cfg,
        cost_model,
        manager,
        instances: Iterable[int],
        *,
        trajs: Mapping[int, TrajFacts],
        straggler: str = "off",
        straggler_threshold: int = 1,
        version: int = 0,
        clock: Callable[[], float] = time.monotonic,
        label: str = "staleflow",
    ):
        if straggler not in ("off", "abort", "truncate"):
            raise ValueError(f"--staleness.straggler={straggler!r} is unknown; choose off, abort or truncate")
        self.trajs = trajs  # the per-trajectory table (the ledger's): looked up by id, never written here
        self.label = label
        """The resolved mode (the runtime passes --mode); it names the batch protocol."""
        self.cfg = cfg
        self.straggler, self.straggler_threshold = straggler, straggler_threshold
        ids = list(instances)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"instances={ids!r} must be a non-empty list of distinct ids")
        self.cost_model, self.clock = cost_model, clock
        check_protocol(label, manager)
        self.manager = manager
        self.router = make_routing(self.cfg.routing, self.cfg, cost_model)
        self.puller = make_pull(self.cfg.pull, self.cfg, cost_model)
        self.instances: dict[int, InstanceState] = {i: InstanceState(i, cost_model.kv_capacity, version) for i in ids}
        self.queue = MultiLevelQueue(self.cfg.mlq, self.cfg.longest_first, self.cfg.new_order)
        self.ps_version = version
        self.live: set[int] = set()  # every live trajectory (queued or in flight)
        self.reserved: set[int] = set()  # live trajectories holding a reservation (= in flight)
        self.group_tag: dict[int, int] = {}  # group_id -> V_traj fixed at its first route
        self.members: dict[int, set[int]] = {}  # group_id -> its items still scheduled here (queued or in flight)
        self.pending_interrupts: set[int] = set()
        self.barrier_budget = 0
        self._admissible: set[int] | None = None
        self._stragglers_done: set[int] = set()
        self._straggled_buffers: set[int] = set()  # buffer versions whose stragglers were handled
        self._out: list[Command] = []
        self._admit: dict[int, bool] = {}
        self.counters: Counter = Counter()
        self.migrated: dict[int, float] = {}  # traj_id -> time of its migration (at most one per trajectory)
        self.moved_off: dict[int, int] = {}  # migrated traj_id -> the instance it left, until re-routed
        self.now = float("-inf")

    # ---- queries used by strategies --------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Trajectories holding a reservation and not yet finished (queued loop-backs included)."""
        return len(self.reserved)

    def group_version(self, group_id: int) -> int | None:
        return self.group_tag.get(group_id)

    def _can_admit_new(self, version: int) -> bool:
        ok = self._admit.get(version)
        if ok is None:
            ok = self._admit[version] = self.manager.can_admit(version)
        return ok

    def routable_at(self, version: int) -> bool:
        """Could some queued trajectory be routed to an instance running `version`?"""
        tagged = self.queue.tagged
        if any(v <= version for v, n in tagged.items() if n > 0):
            return True
        if len(self.queue) > sum(tagged.values()):
            if self.cfg.barrier and self.barrier_budget <= 0:
                return False
            return self._can_admit_new(version)
        return False

    # ---- events --------------------------------------------------------------------------
    def submit(self, traj_ids: Iterable[int]) -> None:
        """Queue new trajectories; each must be in ``trajs`` already (the ledger made it)."""
        for t in traj_ids:
            if t in self.live:
                raise ValueError(f"submit: trajectory id {t} is already live; ids must be unique")
            rec = self.trajs.get(t)
            if rec is None:
                raise ValueError(f"submit: trajectory {t} is not in the trajectory table; the ledger makes it first")
            if min(rec.prompt_len, rec.n_tokens) < 0:
                raise ValueError(f"submit: trajectory {t} has a negative length ({rec.prompt_len=}, {rec.n_tokens=})")
            self.live.add(t)
            self.members.setdefault(rec.group_id, set()).add(t)
            self.queue.push(t, rec.traj_version, rec.tokens)

    def on_snapshot(self, snap: InstanceSnapshot) -> bool:
        """Reconcile a snapshot with the speculative state; False if it was stale and dropped."""
        inst = self._inst(snap.instance)
        return inst.accept(snap)

    def on_finished(self, instance: int, traj_id: int) -> bool:
        """A trajectory finished generation. False if it was already dropped (an Abort crossed the
        finish: group-redundancy surplus, closed window, straggler): it does not count."""
        now = self.clock()
        if traj_id not in self.live:
            self.counters["late_finish"] += 1
            return False
        self._detach(traj_id, now)
        self.queue.remove(traj_id)
        self.pending_interrupts.discard(traj_id)
        self.live.discard(traj_id)
        self.queue.forget(traj_id)
        self.migrated.pop(traj_id, None)
        self.moved_off.pop(traj_id, None)
        self.reserved.discard(traj_id)
        self.members[self.trajs[traj_id].group_id].discard(traj_id)
        for t in self.manager.complete(traj_id):  # group redundancy: the surplus is aborted
            self._drop(t, "surplus", now)
        self.counters["finished"] += 1
        return True

    def on_rewarded(self, group_id: int) -> int | None:
        """The group's reward is known: Occupy. Returns the buffer version it landed in, or None if
        its window closed meanwhile (every admissible buffer became Ready): the group is aborted."""
        if self.manager.group_info(group_id)["state"] == "closed":
            self.abort_group(
                group_id, "window-closed", self.clock(), retry=getattr(self.manager, "retry_closed", False)
            )
            return None
        v = self.manager.occupy(group_id)
        self._forget_group(group_id)
        return v

    def on_interrupted(self, instance: int, traj_ids: Iterable[int]) -> None:
        """Partial trajectories came back from ``instance`` (Interrupt or engine preemption); the loop has
        written their records' n_tokens and origin (== instance). They queue again under their V_traj."""
        now = self.clock()
        for t in traj_ids:
            self.pending_interrupts.discard(t)
            if t not in self.live:  # aborted while the interrupt was in flight
                continue
            rec = self.trajs[t]
            if rec.origin != instance:
                raise ValueError(
                    f"on_interrupted: trajectory {t} came back from instance {instance}, its record says origin "
                    f"{rec.origin}: write the record (n_tokens, origin) before reporting the loop-back"
                )
            self._detach(t, now)
            V = self.group_tag.get(rec.group_id) if rec.traj_version is None else rec.traj_version
            self.queue.push(t, V, rec.tokens)
            self.counters["loop_back"] += 1

    def on_pull_done(self, instance: int, version: int) -> None:
        inst = self._inst(instance)
        inst.version = inst.target_version = version
        inst.syncing = False
        inst.last_change = self.clock()
        self.manager.on_rollout_version(min(i.version for i in self.instances.values()))

    def trainer_blocked(self) -> bool:
        """The mode's weight-sync rule holds the trainer until every instance runs the newest version."""
        return self.puller.blocks_trainer and updating(self)

    def on_new_version(self, version: int) -> None:
        """The PS published `version`; with verl's T (--coordinator.trigger-sync-steps) every T-th counts."""
        if version % self.cfg.trigger_sync_steps == 0:
            self.ps_version = max(self.ps_version, version)

    def on_failed(self, instance: int, traj_id: int, reason: str = "failed") -> None:
        """A trajectory was lost (engine error): drop it; if its group can no longer reach N, the group."""
        if traj_id not in self.live:
            return
        now = self.clock()
        if traj_id in self.reserved:
            for gid in self.manager.abort(traj_id, reason):
                self.abort_group(gid, reason, now, aborted=True)
        self._drop(traj_id, reason, now)

    # ---- the cycle -------------------------------------------------------------------------
    def tick(self, now: float) -> list[Command]:
        self.now = now
        cmds, self._out = self._out, []
        self._admit.clear()
        self.counters["ticks"] += 1
        retry = getattr(self.manager, "retry_closed", False)  # the peers' strict variant regenerates
        for gid in self.manager.closed_windows():
            self.abort_group(gid, "window-closed", now, out=cmds, retry=retry)
        if self.straggler != "off":
            handle_stragglers(self, now, cmds)
        plan_pulls(self, now, cmds)
        # Active migration (paper 6.5) moves in-flight work through partial rollout; without it (interrupt_on_pull
        # False: drain) nothing started is ever interrupted and resumed, so nothing migrates.
        if self.cfg.migration and self.cfg.interrupt_on_pull and not self.pending_interrupts:
            migrate(self, now, cmds)
        if not self.pending_interrupts and not (self.puller.blocks_routing and updating(self)):
            self._route(now, cmds)
        return cmds

    def _route(self, now: float, cmds: list[Command]) -> None:
        cap = self.cfg.max_concurrent
        open_ = [i for i in self.instances.values() if len(i.trajs) < cap and not i.draining]
        if not open_ or not len(self.queue):
            return
        if (
            self.cfg.barrier
            and self.in_flight == 0
            and not any(i.syncing or i.target_version < self.ps_version for i in self.instances.values())
        ):
            self.barrier_budget = self.manager.capacity
        self._admissible = None
        failed: set[tuple] = set()  # (V_traj, tokens) that found no instance since the last route
        for key in self.queue.level_keys():
            fails, leftover = 0, False
            for t in self.queue.iter_level(key, self.queue.level_size(key)):
                if not open_ or fails >= self.cfg.scan_limit:
                    leftover = True
                    break
                rec = self.trajs[t]
                sig = (
                    rec.traj_version if rec.traj_version is not None else self.group_tag.get(rec.group_id),
                    rec.tokens,
                    self.moved_off.get(t, -1) if self.cfg.migration else rec.origin,
                )
                if sig in failed:  # same placement problem as one that just failed: skip cheaply
                    fails, leftover = fails + 1, True
                    continue
                inst, V = self._place(rec, open_, failed, sig)
                if inst is None:
                    fails, leftover = fails + 1, True
                    continue
                fails = 0
                failed.clear()
                self._route_one(rec, inst, V, now, cmds)
                if len(inst.trajs) >= cap:
                    open_.remove(inst)
            if leftover and self.queue.enabled:
                break  # strict priority: newer levels wait for the older one

    def _place(self, rec: TrajFacts, open_: list[InstanceState], failed: set, sig: tuple):
        """Pick an instance for one queued trajectory (None if it must wait) and its V_traj."""
        gid = rec.group_id
        V = sig[0]
        if V is None:  # the first member of a fresh group: dynamic tag = instance post-sync version
            if self.cfg.barrier and self.barrier_budget <= 0:
                failed.add(sig)
                return None, -1
            if self._admissible is None:
                self._admissible = {
                    v for v in {i.target_version for i in self.instances.values()} if self.manager.can_admit(v)
                }
            ok = self._admissible
            cands = [i for i in open_ if i.target_version in ok]
        else:
            if rec.traj_id not in self.reserved and not self.manager.can_admit(V, gid):
                return None, -1
            if rec.origin >= 0 and not self.cfg.migration:  # no migration: resume where it ran
                cands = [i for i in open_ if i.instance == rec.origin and i.target_version >= V]
            else:  # a migrated trajectory does not go back to the instance it left, unless nothing else can run it
                cands = [i for i in open_ if i.target_version >= V]
                left = self.moved_off.get(rec.traj_id, -1)
                cands = [i for i in cands if i.instance != left] or cands
        inst = self.router.choose(rec, V, cands, self) if cands else None
        if inst is None:
            failed.add(sig)
            return None, -1
        return inst, (inst.target_version if V is None else V)

    def _route_one(self, rec: TrajFacts, inst: InstanceState, V: int, now: float, cmds: list[Command]) -> None:
        t, gid = rec.traj_id, rec.group_id
        if t not in self.reserved:
            if gid not in self.group_tag:
                self.group_tag[gid] = V
                if self.cfg.barrier:
                    self.barrier_budget -= 1
            self.manager.reserve(t, gid, V)
            self.reserved.add(t)
            self._admit.clear()
            self._admissible = None
        self.queue.remove(t)
        self.moved_off.pop(t, None)
        inst.add(t, rec.tokens, now)
        cmds.append(Route(t, inst.instance, V))
        self.counters["routes"] += 1

    # ---- bookkeeping -----------------------------------------------------------------------
    def _inst(self, instance: int) -> InstanceState:
        inst = self.instances.get(instance)
        if inst is None:
            raise ValueError(f"unknown instance {instance!r}; known: {sorted(self.instances)}")
        return inst

    def instance_of(self, traj_id: int) -> int:
        """The instance holding the trajectory (-1: none); placement lives once, in InstanceState.trajs."""
        for i, inst in self.instances.items():
            if traj_id in inst.trajs:
                return i
        return -1

    def _detach(self, traj_id: int, now: float) -> int:
        for i, inst in self.instances.items():
            if inst.remove(traj_id, now):
                return i
        return -1

    def _drop(self, traj_id: int, reason: str, now: float, out: list[Command] | None = None) -> None:
        """Forget one live trajectory and tell the runtime to stop it (manager already updated)."""
        if traj_id not in self.live:
            return
        self.live.discard(traj_id)
        gid = self.trajs[traj_id].group_id
        self.queue.remove(traj_id)
        self.queue.forget(traj_id)
        self.migrated.pop(traj_id, None)
        self.moved_off.pop(traj_id, None)
        i = self._detach(traj_id, now)
        self.reserved.discard(traj_id)
        self.pending_interrupts.discard(traj_id)
        self.members.get(gid, set()).discard(traj_id)
        (self._out if out is None else out).append(Abort(i, (traj_id,), reason))
        self.counters[f"aborted_{reason}"] += 1

    def abort_group(
        self,
        gid: int,
        reason: str,
        now: float,
        out: list[Command] | None = None,
        retry: bool = False,
        aborted: bool = False,
    ) -> None:
        if not aborted:
            self.manager.abort_group(gid, reason)
        for t in sorted(self.members.get(gid, ())):
            self._drop(t, reason, now, out)
        (self._out if out is None else out).append(Abort(-1, (), reason, retry, gid))
        self.counters[f"groups_aborted_{reason}"] += 1
        self._forget_group(gid)

    def _forget_group(self, gid: int) -> None:
        self.members.pop(gid, None)
        self.group_tag.pop(gid, None)
        self._stragglers_done.discard(gid)

    def stats(self) -> dict:
        """JSON-able counters and per-instance speculative state (metrics)."""
        return {
            "mode": self.label,
            "queued": len(self.queue),
            "in_flight": self.in_flight,
            "ps_version": self.ps_version,
            "counters": dict(self.counters),
            "instances": {
                i: {"kv": s.kv_tokens, **{k: getattr(s, k) for k in _INSTANCE_STATS}} for i, s in self.instances.items()
            },
        }
