"""Critical-path tail lanes (``--coordinator.tail-lanes``): the trajectories that hold back the oldest staleness
buffer decode on instances kept lightly loaded, alone or with the other critical ones.

Why. A step of a bounded asynchronous run ends when the oldest buffer is Ready, and what it waits for in the
end is its last live trajectories, the long ones. Each decodes at the pace of its instance's step, which its
co-runners slow: their KV is read every step (k1 x KV) and past the batch knee their rows cost compute
(k3 x n). Alone, a step costs about the weights' read (k2); with speculative decoding a lone sequence gains
the most (sim/speculative.py). The protocol knows which trajectories these are: the members of the groups
whose window [V_traj, V_traj + eta] ends at the next buffer (it must take them).

The planner, each tick (not while an Interrupt is outstanding or an instance syncs):
1. the critical set C: live trajectories of groups with V_traj + eta <= the next buffer;
2. a lane holding no member of C goes back to the routing pass (``Lane(i, False)``);
3. a member of C queued in the Trajectory Server (looped back) is routed to an open lane at a version >= its
   V_traj, the one holding the fewest;
4. how many lanes the fleet can spare is read off the state: L = floor(instances x g), g the mean, over the
   members of C in flight, of 1 - step(1, its own KV) / step(its instance's batch, its instance's KV) on the
   router's cost model: a lane may take the fraction of the fleet that equals the fraction of the critical
   path it saves (at least 1). Lanes open only in the buffer's tail, once the members of C in flight off a
   lane are no more than L (before that, C is the whole cohort of the oldest window and a lane each would take
   the fleet), and at most L are open at once;
5. then each such member, most tokens first, gets a lane: its own instance (moving it would cost its KV, the
   longest there is), which routing no longer feeds (``Lane(i, True)``); the other trajectories decoding there
   are given back (``Interrupt(i, ids, "migrate")``: they loop back and the routing pass places them elsewhere,
   with their KV where the engine moves KV, re-prefilled otherwise). Tool waiters stay.

A lane pulls weights like any instance (its critical trajectories keep their KV with keep-KV pulls). Migration
neither moves work off a lane nor counts it as starved (coordinator/migration.py); the routing pass routes
nothing to it (coordinator/routing.py). What it measured: docs/perf.md, "Tail lanes".
"""

from __future__ import annotations

from collections.abc import Iterator

from staleflow.coordinator.types import Interrupt, Lane
from staleflow.trajectory import Route


def critical(ctx) -> dict[int, int]:
    """traj_id -> tokens so far (prompt + generated) of the live trajectories that hold back the next buffer:
    members of the groups whose window ends there (V_traj + eta <= buffer_version)."""
    deadline = ctx.buffer_version - ctx.eta
    due = {g for g, V in ctx.group_versions().items() if V <= deadline}
    if not due:
        return {}
    trajs = ctx.trajs
    return {t: trajs[t].tokens for t, rec in ctx.records().items() if rec.group_id in due}


class TailLanes:
    """The tail-lane planner (module docstring); built by the coordinator when --coordinator.tail-lanes is on."""

    def __init__(self, cfg, cost_model):
        self.cfg, self.cost = cfg, cost_model

    def spare(self, ctx, crit: dict[int, int]) -> int:
        """How many lanes the fleet can spare now (step 4 of the module docstring)."""
        insts, gains = ctx.instances, []
        for t, tokens in crit.items():
            rec = ctx.record(t)
            if rec.state != "in_flight":
                continue
            inst = insts[rec.instance]
            shared = self.cost.step_time(max(1, inst.engaged), inst.kv_tokens)
            gains.append(max(0.0, 1.0 - self.cost.step_time(1, tokens) / shared))
        return int(len(insts) * sum(gains) / len(gains)) if gains else 0

    def plan(self, ctx, now: float) -> Iterator:
        insts = ctx.instances
        if ctx.interrupting or any(i.syncing for i in insts.values()):
            return
        crit = critical(ctx)
        lanes = []
        for inst in insts.values():
            if inst.lane:
                if any(t in crit for t in inst.trajs):
                    lanes.append(inst)
                else:
                    yield Lane(inst.instance, False)
        for t in crit:
            rec, facts = ctx.record(t), ctx.trajs[t]
            if rec.state != "queued" or facts.traj_version is None:
                continue
            room = [i for i in lanes if i.target_version >= facts.traj_version]
            if room:
                yield Route(t, min(room, key=lambda i: (i.engaged, i.kv_tokens)).instance, facts.traj_version)
        off = sorted(
            (
                (n, t)
                for t, n in crit.items()
                if ctx.record(t).state == "in_flight" and not insts[ctx.record(t).instance].lane
            ),
            reverse=True,
        )
        spare = max(1, self.spare(ctx, crit))
        if not off or len(off) > spare:
            return  # not the buffer's tail yet: a lane each would take more of the fleet than it saves
        for _, t in off:
            home = insts[ctx.record(t).instance]
            if home.lane:  # (a critical trajectory promoted its instance earlier in this loop)
                continue
            if sum(i.lane for i in insts.values()) >= spare:
                break
            yield Lane(home.instance, True)
            others = tuple(x for x, r in home.trajs.items() if x not in crit and not r.parked and not r.interrupting)
            if others:
                yield Interrupt(home.instance, others, "migrate")
