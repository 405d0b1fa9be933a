"""Pluggable routing, pull and migration strategies, registered by name (paper sections 6.3-6.5).

A research fork adds a policy in one file::

    from staleflow.coordinator.strategies import register_routing

    @register_routing("my-router")
    class MyRouter:
        def __init__(self, cfg, cost_model): ...
        def choose(self, traj, traj_version, candidates, ctx) -> InstanceState | None: ...

and selects it with ``--coordinator.routing my-router``, or, without registering, by import path:
``--coordinator.routing my_pkg.routers:MyRouter`` (docs/extending.md). ``candidates`` are already filtered by
the coordinator: version >= V_traj, a feasible reservation, not at the concurrency cap. ``traj`` is the
trajectory's record in the ledger (``TrajFacts``, coordinator/types.py: traj_id, group_id, traj_version,
prompt_len, n_tokens generated so far, origin, tokens), looked up by id: read it, never write it.
Pull policies (coordinator/pull.py) answer ``should_pull(inst, ctx) -> bool`` for an instance
behind the PS; the migration policy returns ``(instance, traj_ids) | None``. ``ctx`` is the Coordinator itself
(read-only use: ps_version, instances, routable_at(version), in_flight, cfg, cost_model).
"""

from __future__ import annotations

from typing import Protocol

from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.types import Interrupt, TrajFacts
from staleflow.extensions import Registry, Shape


class RoutingStrategy(Protocol):
    """--coordinator.routing: a class built once per coordinator as ``cls(cfg, cost_model)``."""

    def choose(
        self, traj: TrajFacts, traj_version: int | None, candidates: list[InstanceState], ctx
    ) -> InstanceState | None: ...


class PullPolicy(Protocol):
    """--coordinator.pull: a class built once per coordinator as ``cls(cfg, cost_model)`` (coordinator/pull.py)."""

    blocks_routing: bool
    blocks_trainer: bool

    def should_pull(self, inst: InstanceState, ctx) -> bool: ...


ROUTING: Registry[type[RoutingStrategy]] = Registry(
    "routing strategy",
    "--coordinator.routing",
    Shape.klass(
        2,
        "a class (cfg, cost_model) with choose(traj, traj_version, candidates, ctx) -> InstanceState | None",
        methods=(("choose", 4),),
    ),
)
PULL: Registry[type[PullPolicy]] = Registry(
    "pull policy",
    "--coordinator.pull",
    Shape.klass(
        2,
        "a class (cfg, cost_model) with should_pull(inst, ctx) -> bool and bool class attributes blocks_routing, "
        "blocks_trainer",
        methods=(("should_pull", 2),),
        attrs=(("blocks_routing", bool), ("blocks_trainer", bool)),
    ),
)
register_routing = ROUTING.register
register_pull = PULL.register


def make_routing(name: str, cfg, cost_model) -> RoutingStrategy:
    """The routing strategy a registered name or 'package.module:Class' names, built for this coordinator."""
    return ROUTING.resolve(name)(cfg, cost_model)


def make_pull(name: str, cfg, cost_model) -> PullPolicy:
    """The pull policy a registered name or 'package.module:Class' names, built for this coordinator."""
    return PULL.resolve(name)(cfg, cost_model)


# ---- routing ---------------------------------------------------------------------------------
@register_routing("waterfall")
class Waterfall:
    """Cost-model marginal gain over priority tiers; accept iff gain >= mu * gain on an empty instance.

    Tiers: "version" groups candidates by post-sync version, oldest first (older instances get the
    old work, keeping fresh instances for fresh work), except for the first member of a fresh group
    (dynamic tag), which tries the NEWEST version first (PSRL ``route_strategy.py``): its tag, and
    with it the deadline V_traj + eta, is as late as possible; "reserve" puts instances whose version
    lets the trajectory join its group's existing reservation first, then newer versions first
    (a new reservation lands in the latest buffer, leaving earlier buffers for occupation).
    Only instances where the trajectory can run at once count: no engine-waiting queue and the
    KV fits. If no tier accepts, the trajectory stays in the TS (retried next tick).
    """

    def __init__(self, cfg, cost_model):
        self.cfg, self.cost = cfg, cost_model

    def tiers(self, candidates: list[InstanceState], traj: TrajFacts, ctx) -> list[list[InstanceState]]:
        by: dict[int, list[InstanceState]] = {}
        for inst in candidates:
            by.setdefault(inst.target_version, []).append(inst)
        if self.cfg.tiers == "version":
            fresh = traj.traj_version is None and ctx.group_version(traj.group_id) is None
            return [by[v] for v in sorted(by, reverse=fresh)]
        joined = ctx.group_version(traj.group_id)
        first = [by[v] for v in sorted(by, reverse=True) if joined is not None and v == joined]
        return first + [by[v] for v in sorted(by, reverse=True) if joined is None or v != joined]

    budget = 0
    """Token budget per request (0: none; see WaterfallBudget)."""

    def request_tokens(self, traj: TrajFacts) -> int:
        return traj.tokens

    def instance_tokens(self, inst: InstanceState) -> int:
        return inst.kv_tokens

    def choose(self, traj: TrajFacts, traj_version: int | None, candidates: list[InstanceState], ctx):
        tokens = self.request_tokens(traj)
        floor = self.cfg.mu * self.cost.ideal_gain(tokens)
        c = self.cost
        k1, k2, k3, b3, k4 = c.k1, c.k2, c.k3, c.b3, c.k4
        for tier in self.tiers(candidates, traj, ctx):
            best, best_gain = None, -1.0
            for inst in tier:
                kv = self.instance_tokens(inst)
                if inst.waiting > 0 or kv + tokens > inst.kv_capacity:
                    continue
                # cost.gain(running, kv, tokens) inlined (the router's hot loop); running = the held
                # trajectories not parked on a tool call, since nothing waits here (a parked one decodes
                # nothing; its KV still counts, it is held). Same expressions, so the same floats.
                n = inst.engaged
                kv2 = kv + tokens
                g = (n + 1) / (k1 * kv2 + max(k2, k3 * (n + 1) + b3) + k4) - (
                    n / (k1 * kv + max(k2, k3 * n + b3) + k4) if n > 0 else 0.0
                )
                if g > best_gain or (g == best_gain and inst.engaged < best.engaged):
                    best, best_gain = inst, g
            if best is not None and best_gain >= floor:
                return best
        return None


@register_routing("waterfall-budget")
class WaterfallBudget(Waterfall):
    """The waterfall with PSRL's per-request token budget (``throughput_optimal_with_budget``, budget
    1024): a request counts as prompt + its generated tokens rounded UP to the next budget multiple (at
    least one budget for a fresh one), and an instance as its KV plus one budget of growth per held
    request, so the "KV fits" check and the marginal gain see the KV a trajectory is about to grow into."""

    budget = 1024

    def request_tokens(self, traj: TrajFacts) -> int:
        return traj.prompt_len + -(-(traj.n_tokens + 1) // self.budget) * self.budget

    def instance_tokens(self, inst: InstanceState) -> int:
        return inst.kv_tokens + self.budget * inst.load


@register_routing("least-loaded")
class LeastLoaded:
    """Fewest held trajectories (running + waiting + parked) first; ties by instance id (veRL/AReaL style)."""

    def __init__(self, cfg, cost_model):
        pass

    def choose(self, traj, traj_version, candidates, ctx):
        return min(candidates, key=lambda i: (i.load, i.instance)) if candidates else None


@register_routing("round-robin")
class RoundRobin:
    """Cycle over instances; skip those that are not candidates for this trajectory."""

    def __init__(self, cfg, cost_model):
        self.next = 0

    def choose(self, traj, traj_version, candidates, ctx):
        if not candidates:
            return None
        ids = sorted(c.instance for c in candidates)
        pick = next((i for i in ids if i >= self.next), ids[0])
        self.next = pick + 1
        return next(c for c in candidates if c.instance == pick)


# ---- migration -------------------------------------------------------------------------------
def migrate(ctx, now: float, cmds: list) -> None:
    """Append this tick's migration (at most one instance's trajectories) and record it."""
    picked = pick_migration(ctx)
    if picked is None:
        return
    inst, ids = picked
    cmds.append(Interrupt(inst.instance, ids, "migrate"))
    for t in ids:
        ctx.migrated[t] = now
        ctx.moved_off[t] = inst.instance
    ctx.pending_interrupts.update(ids)
    inst.last_change = now
    ctx.counters["migrations"] += 1
    ctx.counters["interrupted"] += len(ids)


def pick_migration(ctx) -> tuple[InstanceState, tuple[int, ...]] | None:
    """Paper 6.5: one instance per tick, never while any instance syncs. A trajectory parked on a tool
    call (``InstanceState.parked``) is never picked and never counted: moving it frees no decode
    capacity, and its call would be cancelled and re-run wherever it resumed.

    1. Waiting-queue trigger: an instance whose engine queue exceeds phi_wait gives back its
       newest trajectories beyond phi_wait (the engine queued them; another instance may run them).
    2. Throughput-gap trigger: for each starved instance s (nothing routable at its version and
       room to run more), every other instance j with version <= s's has ratio indicator_j /
       indicator_s; the largest ratio above psi gives back every trajectory it holds that was never
       migrated and is not parked (they loop back and are re-routed, never to j), unless fewer than
       max(2, migration_stop) such trajectories remain, one migrated less than migration_cooldown_s
       ago, or j made no decode progress in its last snapshot while holding running work: it is
       still prefilling what it was just given (a resumed trajectory recomputes its KV first), and
       moving that restarts the prefill elsewhere.
       Each trajectory moves at most once: a move costs a full re-prefill, and without the limit
       two instances could hand the same long loop-backs back and forth forever whenever their
       re-prefill outlasts the cooldown (the simulator found such a livelock).
       Computed in O(instances): for each j the best s is the least-loaded starved instance
       among those at a version >= j's (a suffix minimum over versions).
    """
    cfg = ctx.cfg
    if any(i.syncing for i in ctx.instances.values()):
        return None
    insts = list(ctx.instances.values())
    over = [i for i in insts if i.waiting > cfg.phi_wait]
    if over:
        inst = max(over, key=lambda i: (i.waiting, -i.instance))
        movable = [t for t in inst.trajs if t not in inst.parked]
        return inst, tuple(movable[-(inst.waiting - cfg.phi_wait) :])
    if cfg.psi == 0:  # the throughput-gap trigger is off (the peers' NEVER_MIGRATE)
        return None
    routable: dict[int, bool] = {}
    low: dict[int, float] = {}  # version -> smallest indicator of a starved instance at that version
    for s in insts:
        v = s.target_version
        if s.waiting or len(s.trajs) >= cfg.max_concurrent:
            continue
        if v not in routable:
            routable[v] = ctx.routable_at(v)
        if not routable[v]:
            x = s.indicator(cfg.migration_indicator)
            low[v] = min(low.get(v, x), x)
    if not low:
        return None
    suffix: dict[int, float] = {}  # version -> min indicator over starved instances at >= version
    run = float("inf")
    for v in sorted(low, reverse=True):
        run = min(run, low[v])
        suffix[v] = run
    vs = sorted(suffix)
    best, best_key = None, None
    stop = max(2, cfg.migration_stop)  # moving a lone trajectory cannot make it decode faster
    cool = ctx.now - cfg.migration_cooldown_s
    for j in insts:
        if j.engaged < stop or any(ctx.migrated.get(t, -1e300) > cool for t in j.trajs):
            continue
        if j.running and j.tokens_per_s <= 0:  # prefilling
            continue
        if sum(t not in ctx.migrated and t not in j.parked for t in j.trajs) < stop:
            continue
        k = next((v for v in vs if v >= j.target_version), None)
        if k is None:
            continue
        base = suffix[k]
        load = j.indicator(cfg.migration_indicator)
        if base >= load:  # j is no busier than the starved one (also skips j being that instance)
            continue
        ratio = float("inf") if base <= 0 else load / base
        key = (ratio, load, -j.instance)  # ties (e.g. a starved instance with load 0): the busiest
        if ratio > cfg.psi and (best_key is None or key > best_key):
            best, best_key = j, key
    if best is None:
        return None
    return best, tuple(t for t in best.trajs if t not in ctx.migrated and t not in best.parked)
