"""Pluggable strategies, registered by name (paper sections 6.3-6.5): they read, the coordinator writes.

A strategy reads a read-only view of the coordinator (``ctx``: coordinator/view.py) and returns its
decision; the coordinator checks it and applies it (``Coordinator.apply``: the scheduling records'
transition function is the one writer). Three kinds, each a registry:

- routing (``--coordinator.routing``): ``choose(traj, traj_version, candidates, ctx) -> InstanceState | None``,
  the instance a queued trajectory is routed to (the coordinator makes the Route). ``candidates`` are already
  filtered by the coordinator: version >= V_traj, a feasible reservation, not at the concurrency cap.
  ``traj`` is the trajectory's record in the ledger (``TrajFacts``, coordinator/types.py: traj_id, group_id,
  traj_version, prompt_len, n_tokens generated so far, origin, tokens), looked up by id: read it, never write it.
- pull policies (``--coordinator.pull``, coordinator/pull.py): ``should_pull(inst, ctx) -> bool`` for an
  instance behind the PS; the pull planner turns a yes into a ``Pull``.
- planners (``--coordinator.planners``, run every tick after the built-in ones: stragglers, pulls,
  migration): ``plan(ctx, now) -> iterable of commands`` among ``Route`` (a queued trajectory to an
  instance), ``Interrupt`` (reason "migrate": move work off an instance; "truncate"), ``Pull`` and
  ``Abort`` (a whole group: ``Abort(-1, (), reason, retry, group_id)``). Commands are applied in the order
  they come (a generator sees the effect of its earlier ones); a command the state does not allow is a
  ValueError naming it. The built-in migration (coordinator/migration.py) is one.

A research fork adds one in one file::

    from staleflow.coordinator.strategies import register_routing

    @register_routing("my-router")
    class MyRouter:
        def __init__(self, cfg, cost_model): ...
        def choose(self, traj, traj_version, candidates, ctx) -> InstanceState | None: ...

and selects it with ``--coordinator.routing my-router``, or, without registering, by import path:
``--coordinator.routing my_pkg.routers:MyRouter`` (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.types import Command, TrajFacts
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


class Planner(Protocol):
    """--coordinator.planners: a class built once per coordinator as ``cls(cfg, cost_model)``."""

    def plan(self, ctx, now: float) -> Iterable[Command]: ...


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
PLANNERS: Registry[type[Planner]] = Registry(
    "planner",
    "--coordinator.planners",
    Shape.klass(
        2,
        "a class (cfg, cost_model) with plan(ctx, now) -> an iterable of Route / Interrupt / Pull / Abort commands",
        methods=(("plan", 2),),
    ),
)
register_routing = ROUTING.register
register_pull = PULL.register
register_planner = PLANNERS.register


def make_routing(name: str, cfg, cost_model) -> RoutingStrategy:
    """The routing strategy a registered name or 'package.module:Class' names, built for this coordinator."""
    return ROUTING.resolve(name)(cfg, cost_model)


def make_pull(name: str, cfg, cost_model) -> PullPolicy:
    """The pull policy a registered name or 'package.module:Class' names, built for this coordinator."""
    return PULL.resolve(name)(cfg, cost_model)


def make_planner(name: str, cfg, cost_model) -> Planner:
    """The planner a registered name or 'package.module:Class' names, built for this coordinator."""
    return PLANNERS.resolve(name)(cfg, cost_model)


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
