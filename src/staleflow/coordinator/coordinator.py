"""The staleness-aware coordinator: the Snapshot-Command cycle (paper section 6).

Pure logic shared by the real controller and the simulator: no torch, no sockets, and an
injectable clock. The runtime (or simulator) feeds events and calls ``tick(now)`` about every
10 ms; each tick returns the commands to execute, in order:

    1. aborts decided since the last tick (group redundancy surplus, failures),
    2. closed windows (groups that can no longer be placed) and stuck-buffer stragglers,
    3. Pull decisions (each preceded by an Interrupt of the instance's in-flight work, tool waiters excepted),
    4. at most one migration (never while an instance syncs),
    5. the commands of the extra planners (--coordinator.planners),
    6. the routing pass over the multi-level queue (paused while interrupted work has not
       looped back yet, so the queue order stays right).
Steps 2-5 are planners (strategies that read the read-only view, coordinator/view.py, and return
commands); ``apply`` checks each command and applies it, so the scheduling records' transition
function (coordinator/record.py: one record per live trajectory) stays their only writer.

Reserve happens at Route time with a dynamic version tag: the first member of a prompt group
routed to an instance fixes the group's V_traj to that instance's post-sync version; later
members and every loop-back keep it. Candidates always have post-sync version >= V_traj.

Runtime contract (staleflow.controller.loop drives it, in the runtime and the simulator alike):
``submit`` new trajectories (ids); report ``on_snapshot``, ``on_finished`` (False: the trajectory
was already dropped, e.g. as group-redundancy surplus), ``on_rewarded`` once the group's N finished
members are rewarded (Occupy), ``on_interrupted`` (partial outputs came back), ``on_pull_done``,
``on_new_version`` (the PS published v), ``on_failed``. The trainer side uses the manager directly
(``ready_version`` / ``consume``). The config arrives with its mode already applied (config.resolve).
Per trajectory it keeps one scheduling record (where it is: queued, in flight, interrupting, parked;
its instance, group, arrival and migration marks); the facts it acts on (group, V_traj, prompt length,
tokens generated, origin) it looks up by id in ``trajs``, the ledger's table (``TrajFacts``), read-only.

With migration off (``--coordinator.migration false``) a loop-back resumes on the instance it
was interrupted on (its ``origin``), never elsewhere. The batch protocol (``manager``) is the one
the mode names (staleflow.modes): StaleFlow's StalenessManager or a peer's count-based rule.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.lanes import TailLanes
from staleflow.coordinator.migration import Migration
from staleflow.coordinator.mlq import MultiLevelQueue
from staleflow.coordinator.pull import PullPlanner, updating
from staleflow.coordinator.record import END, INTERRUPT, LOOP_BACK, PARK, SUBMIT, TRUNCATE, UNPARK, Schedule
from staleflow.coordinator.routing import RoutingPass
from staleflow.coordinator.stragglers import Stragglers
from staleflow.coordinator.strategies import make_planner, make_pull, make_routing
from staleflow.coordinator.types import Abort, Command, InstanceSnapshot, Interrupt, Lane, Pull, TrajFacts
from staleflow.coordinator.view import CoordinatorView
from staleflow.modes import check_protocol
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
        sync_every: int = 1,
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
        self.instances: dict[int, InstanceState] = {i: InstanceState(i, cost_model.kv_capacity, version) for i in ids}
        self.queue = MultiLevelQueue(self.cfg.mlq, self.cfg.longest_first, self.cfg.new_order)
        self.sched = Schedule(self.queue, self.instances)
        """The scheduling records of the live trajectories and their transition function (record.py)."""
        self.routing = RoutingPass(self)
        """Step 6 of the tick and the admission state it keeps (routing.py)."""
        self.view = CoordinatorView(self)
        """What every strategy reads (read-only); they return commands, ``apply`` applies them."""
        self.router = make_routing(self.cfg.routing, self.cfg, cost_model)
        self.puller = make_pull(self.cfg.pull, self.cfg, cost_model)
        self.pulls = PullPlanner(self.puller)
        self.stragglers = Stragglers(straggler, straggler_threshold) if straggler != "off" else None
        self.migration = Migration(self.cfg, cost_model)
        self.planners = [make_planner(name, self.cfg, cost_model) for name in self.cfg.planners]
        if self.cfg.tail_lanes:  # (--coordinator.tail-lanes: the built-in planner, first of the extra ones)
            self.planners.insert(0, TailLanes(self.cfg, cost_model))
        self.ps_version = version
        if type(sync_every) is not int or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} must be an int >= 1")
        self.sync_every = sync_every
        """Instances pull every sync_every-th published version (the mode's: verl's trigger_parameter_sync_step T)."""
        self.group_tag: dict[int, int] = {}  # group_id -> V_traj fixed at its first route
        self._out: list[Command] = []
        self.counters: Counter = Counter()
        self.now = float("-inf")

    # ---- queries -----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Trajectories holding a reservation and not yet finished (queued loop-backs included)."""
        return self.sched.reserved

    @property
    def records(self) -> Mapping:
        """traj_id -> SchedRecord of every live trajectory (read-only)."""
        return MappingProxyType(self.sched.records)

    def group_version(self, group_id: int) -> int | None:
        return self.group_tag.get(group_id)

    def instance_of(self, traj_id: int) -> int:
        """The instance holding the trajectory (-1: none)."""
        rec = self.sched.get(traj_id)
        return -1 if rec is None else rec.instance

    def routable_at(self, version: int) -> bool:
        """Could some queued trajectory be routed to an instance running `version`?"""
        return self.routing.routable_at(version)

    # ---- events --------------------------------------------------------------------------
    def submit(self, traj_ids: Iterable[int]) -> None:
        """Queue new trajectories; each must be in ``trajs`` already (the ledger made it)."""
        for t in traj_ids:
            if t in self.sched:
                raise ValueError(f"submit: trajectory id {t} is already live; ids must be unique")
            rec = self.trajs.get(t)
            if rec is None:
                raise ValueError(f"submit: trajectory {t} is not in the trajectory table; the ledger makes it first")
            if min(rec.prompt_len, rec.n_tokens) < 0:
                raise ValueError(f"submit: trajectory {t} has a negative length ({rec.prompt_len=}, {rec.n_tokens=})")
            self.sched.transition(t, SUBMIT, group_id=rec.group_id, traj_version=rec.traj_version, tokens=rec.tokens)

    def on_snapshot(self, snap: InstanceSnapshot) -> bool:
        """Reconcile a snapshot with the speculative state; False if it was stale and dropped."""
        inst = self._inst(snap.instance)
        if not inst.accept(snap):
            return False
        if snap.parked_ids or inst.n_parked:  # the parked marks follow the snapshot
            parked = set(snap.parked_ids)
            for t, rec in list(inst.trajs.items()):
                if rec.parked != (t in parked):
                    self.sched.transition(t, PARK if t in parked else UNPARK)
        return True

    def on_finished(self, instance: int, traj_id: int) -> bool:
        """A trajectory finished generation. False if it was already dropped (an Abort crossed the
        finish: group-redundancy surplus, closed window, straggler): it does not count."""
        now = self.clock()
        if traj_id not in self.sched:
            self.counters["late_finish"] += 1
            return False
        self.sched.transition(traj_id, END, now=now)
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
            if t not in self.sched:  # aborted while the interrupt was in flight
                continue
            rec = self.trajs[t]
            if rec.origin != instance:
                raise ValueError(
                    f"on_interrupted: trajectory {t} came back from instance {instance}, its record says origin "
                    f"{rec.origin}: write the record (n_tokens, origin) before reporting the loop-back"
                )
            V = self.group_tag.get(rec.group_id) if rec.traj_version is None else rec.traj_version
            self.sched.transition(t, LOOP_BACK, now=now, traj_version=V, tokens=rec.tokens)
            self.counters["loop_back"] += 1

    def on_pull_done(self, instance: int, version: int) -> None:
        self._inst(instance)._pulled(version, self.clock())
        self.manager.on_rollout_version(min(i.version for i in self.instances.values()))

    def trainer_blocked(self) -> bool:
        """The mode's weight-sync rule holds the trainer until every instance runs the newest version."""
        return self.puller.blocks_trainer and updating(self.view)

    def on_new_version(self, version: int) -> None:
        """The PS published `version`; with verl's T (--peer.verl-fully-async.trigger-sync-steps) every T-th counts."""
        if version % self.sync_every == 0:
            self.ps_version = max(self.ps_version, version)

    def on_failed(self, instance: int, traj_id: int, reason: str = "failed") -> None:
        """A trajectory was lost (engine error): drop it; if its group can no longer reach N, the group."""
        rec = self.sched.get(traj_id)
        if rec is None:
            return
        now = self.clock()
        if rec.reserved:
            for gid in self.manager.abort(traj_id, reason):
                self.abort_group(gid, reason, now, aborted=True)
        self._drop(traj_id, reason, now)

    # ---- the cycle -------------------------------------------------------------------------
    def tick(self, now: float) -> list[Command]:
        self.now = now
        cmds, self._out = self._out, []
        self.routing.new_tick()
        self.counters["ticks"] += 1
        retry = getattr(self.manager, "retry_closed", False)  # the peers' strict variant regenerates
        for gid in self.manager.closed_windows():
            self.abort_group(gid, "window-closed", now, out=cmds, retry=retry)
        if self.stragglers is not None:
            self._plan(self.stragglers, now, cmds)
        self._plan(self.pulls, now, cmds)
        # Active migration (paper 6.5) moves in-flight work through partial rollout; without it (interrupt_on_pull
        # False: drain) nothing started is ever interrupted and resumed, so nothing migrates.
        if self.cfg.migration and self.cfg.interrupt_on_pull and not self.sched.interrupting:
            self._plan(self.migration, now, cmds)
        for planner in self.planners:
            self._plan(planner, now, cmds)
        if not self.sched.interrupting and not (self.puller.blocks_routing and updating(self.view)):
            self.routing.run(now, cmds)
        return cmds

    def _plan(self, planner, now: float, cmds: list[Command]) -> None:
        for cmd in planner.plan(self.view, now):
            self.apply(cmd, now, cmds)

    # ---- commands: what strategies return, checked and applied ---------------------------------
    def apply(self, cmd: Command, now: float, out: list[Command]) -> None:
        """Check one command a strategy returned and apply it; what the runtime must execute goes to
        ``out``. A command the state does not allow is a ValueError naming it (nothing is changed)."""
        if isinstance(cmd, Pull):
            self._apply_pull(cmd, now, out)
        elif isinstance(cmd, Interrupt):
            self._apply_interrupt(cmd, now, out)
        elif isinstance(cmd, Route):
            self._apply_route(cmd, now, out)
        elif isinstance(cmd, Lane):
            self._inst(cmd.instance)._set_lane(cmd.open)  # the coordinator's own state: nothing to execute
            self.counters["lanes_opened" if cmd.open else "lanes_closed"] += 1
        elif isinstance(cmd, Abort):
            if cmd.group_id < 0 or cmd.traj_ids or cmd.instance >= 0:
                raise ValueError(f"{cmd!r}: a strategy aborts whole groups, Abort(-1, (), reason, retry, group_id)")
            self.abort_group(cmd.group_id, cmd.reason, now, out=out, retry=cmd.retry)
        else:
            raise ValueError(f"{cmd!r}: a strategy returns Route, Interrupt, Pull, Abort or Lane commands")

    def _apply_pull(self, cmd: Pull, now: float, out: list[Command]) -> None:
        """Partial rollout interrupts the instance's work first (tool waiters stay), keep-KV interrupts
        nothing, no partial rollout drains it (the Pull waits until it is empty)."""
        inst = self._inst(cmd.instance)
        if inst.syncing or not inst.target_version < cmd.version <= self.ps_version:
            raise ValueError(
                f"{cmd!r}: instance {inst.instance} (syncing {inst.syncing}, version {inst.target_version}) cannot "
                f"pull it; the newest version is {self.ps_version}"
            )
        if inst.load and not self.cfg.interrupt_on_pull:  # no partial rollout: finish the work first, take no more
            inst._drain()
            return
        if inst.load and not self.cfg.keep_kv_on_pull:  # partial rollout with re-prefill: interrupt, loop back
            ids = tuple(t for t, r in inst.trajs.items() if not r.parked)  # tool waiters stay (their call goes on)
            if ids:
                out.append(Interrupt(inst.instance, ids, "pull"))
                for t in ids:
                    self.sched.transition(t, INTERRUPT, now=now, reason="pull")
                self.counters["interrupted"] += len(ids)
            if len(ids) < inst.load:
                self.counters["pull_kept_parked"] += inst.load - len(ids)
        out.append(Pull(inst.instance, cmd.version))
        inst._start_pull(cmd.version, now)
        self.counters["pulls"] += 1

    def _apply_interrupt(self, cmd: Interrupt, now: float, out: list[Command]) -> None:
        """reason "migrate": the trajectories leave the instance (marked, routed elsewhere when they loop back);
        "truncate": a straggler's partial output is final (instance -1: queued ones, taken out of the queue)."""
        if cmd.reason not in ("migrate", "truncate"):
            raise ValueError(f"{cmd!r}: a strategy interrupts to migrate or truncate (a Pull brings its own)")
        recs = [self.sched.get(t) for t in cmd.traj_ids]
        if cmd.reason == "migrate" and cmd.instance < 0 or not cmd.traj_ids:
            raise ValueError(f"{cmd!r}: name the instance and the trajectories it holds")
        bad = [t for t, r in zip(cmd.traj_ids, recs) if r is None or r.instance != cmd.instance]  # (-1: not held)
        bad += [t for t, r in zip(cmd.traj_ids, recs) if cmd.reason == "migrate" and r is not None and r.parked]
        if bad:
            raise ValueError(f"{cmd!r}: trajectories {bad} are not held by (or parked on) instance {cmd.instance}")
        out.append(cmd)
        if cmd.reason == "truncate":
            if cmd.instance < 0:
                for t in cmd.traj_ids:
                    self.sched.transition(t, TRUNCATE)
            self.counters["truncated"] += len(cmd.traj_ids)
            return
        for t in cmd.traj_ids:
            self.sched.transition(t, INTERRUPT, now=now, reason="migrate")
        self._inst(cmd.instance)._touch(now)
        self.counters["migrations"] += 1
        self.counters["interrupted"] += len(cmd.traj_ids)

    def _apply_route(self, cmd: Route, now: float, out: list[Command]) -> None:
        """A queued trajectory to a chosen instance, under the rules the routing pass follows."""
        srec, rec = self.sched.get(cmd.traj_id), self.trajs.get(cmd.traj_id)
        inst = self._inst(cmd.instance)
        if srec is None or srec.place is None:
            raise ValueError(f"{cmd!r}: trajectory {cmd.traj_id} is not queued")
        V = rec.traj_version if rec.traj_version is not None else self.group_tag.get(rec.group_id)
        V = inst.target_version if V is None else V
        if cmd.traj_version != V or inst.target_version < V or inst.draining or inst.load >= self.cfg.max_concurrent:
            raise ValueError(
                f"{cmd!r}: its V_traj is {V}; instance {inst.instance} runs version {inst.target_version} "
                f"(draining {inst.draining}, holds {inst.load} of {self.cfg.max_concurrent})"
            )
        if not srec.reserved and not self.manager.can_admit(V, rec.group_id):
            raise ValueError(f"{cmd!r}: the batch protocol has no room for V_traj {V} now")
        if not srec.reserved and self.cfg.barrier and rec.group_id not in self.group_tag and not self.routing.budget:
            raise ValueError(f"{cmd!r}: the batch barrier admits no new group now")
        self.routing.route_one(rec, srec, inst, V, now, out)

    # ---- bookkeeping -----------------------------------------------------------------------
    def _inst(self, instance: int) -> InstanceState:
        inst = self.instances.get(instance)
        if inst is None:
            raise ValueError(f"unknown instance {instance!r}; known: {sorted(self.instances)}")
        return inst

    def _drop(self, traj_id: int, reason: str, now: float, out: list[Command] | None = None) -> None:
        """Forget one live trajectory and tell the runtime to stop it (manager already updated)."""
        rec = self.sched.get(traj_id)
        if rec is None:
            return
        i = rec.instance
        self.sched.transition(traj_id, END, now=now)
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
        for t in self.sched.group_members(gid):
            self._drop(t, reason, now, out)
        (self._out if out is None else out).append(Abort(-1, (), reason, retry, gid))
        self.counters[f"groups_aborted_{reason}"] += 1
        self._forget_group(gid)

    def _forget_group(self, gid: int) -> None:
        self.group_tag.pop(gid, None)

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
