"""Active migration (paper 6.5) as a planner: it reads the coordinator's view and returns the Interrupt
(reason "migrate") of at most one instance's trajectories per tick; the coordinator applies it (marks the
records as migrated, counts the move) and routes the loop-backs elsewhere (never back to the instance they
left, unless nothing else can run them). The coordinator runs it only with --coordinator.migration, partial
rollout on, and no Interrupt outstanding.
"""

from __future__ import annotations

from collections.abc import Iterator

from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.types import Interrupt

_NEVER = -1e300  # migrated_at of a trajectory that never moved, for the cooldown comparison


class Migration:
    """The built-in migration planner (``pick_migration``'s choice as a command; the Planner interface, run by
    --coordinator.migration, not by name)."""

    def __init__(self, cfg, cost_model):
        self.cfg = cfg

    def plan(self, ctx, now: float) -> Iterator[Interrupt]:
        picked = pick_migration(ctx)
        if picked is not None:
            inst, ids = picked
            yield Interrupt(inst.instance, ids, "migrate")


def pick_migration(ctx) -> tuple[InstanceState, tuple[int, ...]] | None:
    """Paper 6.5: one instance per tick, never while any instance syncs. A trajectory parked on a tool
    call (its record's ``parked``) is never picked and never counted: moving it frees no decode
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
    insts = list(ctx.instances.values())
    if any(i.syncing for i in insts):
        return None
    insts = [i for i in insts if not i.lane]  # a tail lane is kept light on purpose: neither starved nor a source
    over = [i for i in insts if i.waiting > cfg.phi_wait]
    if over:
        inst = max(over, key=lambda i: (i.waiting, -i.instance))
        movable = [t for t, r in inst.trajs.items() if not r.parked]
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
        if j.engaged < stop:
            continue
        if j.running and j.tokens_per_s <= 0:  # prefilling
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
        if ratio <= cfg.psi or (best_key is not None and key <= best_key):
            continue
        # the per-trajectory conditions last (they read every record j holds): only for a new best
        held = j.trajs.values()
        if any((_NEVER if r.migrated_at is None else r.migrated_at) > cool for r in held):
            continue
        if sum(r.migrated_at is None and not r.parked for r in held) < stop:
            continue
        best, best_key = j, key
    if best is None:
        return None
    return best, tuple(t for t, r in best.trajs.items() if r.migrated_at is None and not r.parked)
