"""Pull (weight synchronisation) policies and the Pull / Interrupt commands they lead to (paper 6.4).

A policy decides WHEN an instance behind the Parameter Server loads the new version; two flags
say what else the system's weight-sync rule stops meanwhile:
  ``blocks_routing`` nothing is routed while an update is in progress (AReaL and verl fully-async
                     pause the whole rollout side for one global update);
  ``blocks_trainer`` the trainer does not start its next step before every instance runs the
                     newest version (the trainer itself sends the weights: AReaL's
                     ``update_weights``, verl's ``sync_weights`` / ``sync_rollout_weights``).
How in-flight work crosses a pull is the coordinator config's ``interrupt_on_pull``:
  True  (partial rollout) the instance's trajectories are interrupted, loop back with their tokens
        and resume on an instance at version >= V_traj, recomputing their KV. A multi-turn trajectory
        parked on a tool call (the snapshot's ``parked_ids``) is NOT interrupted: it stays, its env step
        goes on, the weight load frees its held KV, and when its observation arrives its prefix plus the
        observation is prefilled under the new weights and its next turn decodes there (interrupting it
        would cancel the call and re-run it wherever it resumed: the tool time twice, a side effect
        twice). The rule is partial rollout's: every token generated after the load comes from a prefix
        prefilled under the new weights. The snapshot may be a tick old: a trajectory thought parked that
        is decoding again is interrupted by the instance's own pull (workers/rollout.py, sim/backend.py)
        and comes back as a loop-back the coordinator did not ask for. With ``keep_kv_on_pull``
        they are NOT interrupted: they stay on the instance, keep their KV across the weight load and
        continue with the new weights (in-flight weight update; V_traj, and with it the bound, is
        unchanged: the oldest token still dates from V_traj);
  False (no partial rollout) the instance DRAINS: it takes no new work, its in-flight trajectories
        finish under the old weights, and the Pull is sent once it is empty. The runtime and the
        simulator execute the same commands, so they agree on this by construction.
The policy only answers WHEN; ``PullPlanner`` turns its answers into ``Pull`` commands each tick, and the
coordinator applies each (``Coordinator.apply``): the interrupt-or-drain mechanism above is its, not the
policy's.
"""

from __future__ import annotations

from collections.abc import Iterator

from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.strategies import PullPolicy, register_pull
from staleflow.coordinator.types import Pull


class _Policy:
    blocks_routing = False
    blocks_trainer = False

    def __init__(self, cfg, cost_model):
        self.cfg = cfg


@register_pull("status")
class StatusPull(_Policy):
    """StaleFlow: pull when the instance has no engine queue, nothing in the TS is routable to it at
    its current version, and its load indicator is at or below the threshold (paper 6.4)."""

    def should_pull(self, inst: InstanceState, ctx) -> bool:
        if inst.waiting > 0 or ctx.routable_at(inst.target_version):
            return False
        return inst.indicator(self.cfg.pull_indicator) <= self.cfg.pull_threshold


@register_pull("greedy")
class GreedyPull(_Policy):
    """Pull as soon as a newer version exists, each instance on its own (the status-pull ablation)."""

    def should_pull(self, inst, ctx) -> bool:
        return True


@register_pull("idle")
class IdlePull(_Policy):
    """Batch boundary (verl sync and one-step-off): pull only once nothing is in flight anywhere, and
    train the next batch only with the new weights on every instance (``sync_rollout_weights``
    runs before the next ``update_actor``)."""

    blocks_trainer = True

    def should_pull(self, inst, ctx) -> bool:
        return ctx.in_flight == 0


@register_pull("pause-all")
class PauseAllPull(_Policy):
    """One global update per version (AReaL ``pause`` + ``update_weights`` + ``resume``; verl
    fully-async ``ParameterSynchronizer.sync_weights``): every instance pulls at once, routing waits
    until all have the new weights, and so does the trainer (it sends them)."""

    blocks_routing = blocks_trainer = True

    def should_pull(self, inst, ctx) -> bool:
        return True


def updating(ctx) -> bool:
    """Some instance does not run the newest published version yet (a pull is due or in progress)."""
    return any(i.syncing or i.version < ctx.ps_version for i in ctx.instances.values())


class PullPlanner:
    """Each tick: a ``Pull`` to the newest version for every instance behind it whose policy says so (or that
    drains before its pull); the coordinator applies each before the next instance is asked."""

    def __init__(self, policy: PullPolicy):
        self.policy = policy

    def plan(self, ctx, now: float) -> Iterator[Pull]:
        ps = ctx.ps_version  # (applying a Pull does not change it)
        for inst in ctx.instances.values():
            if inst.syncing or inst.target_version >= ps:
                continue
            if inst.draining or self.policy.should_pull(inst, ctx):
                yield Pull(inst.instance, ps)
