"""A routing strategy: each trajectory goes to the instance left with the most free KV cache.

The default ``waterfall`` scores instances with a throughput cost model; this one needs no cost
model and looks at memory only: among the candidates the coordinator offers (already at a version
>= V_traj, with a reservation and under the concurrency cap) it keeps those with no engine queue
where the trajectory's KV fits, and picks the one with the most free KV tokens (ties: the lowest
instance id). No candidate fits: None, and the trajectory waits in the Trajectory Server until a
later tick.

The coordinator is the same code in the runtime and in the simulator, so the class runs in both.
From the repository root:

    PYTHONPATH=$PWD ./launch.sh --preset tiny --coordinator.routing examples.kv_router:MostFreeKV
    PYTHONPATH=$PWD python -m staleflow sim --preset cpu-small --modes staleflow --no-ablation \
        --coordinator.routing examples.kv_router:MostFreeKV
"""

from __future__ import annotations

from examples.calls import record
from staleflow.coordinator.instance import InstanceState
from staleflow.coordinator.types import TrajFacts


class MostFreeKV:
    """The interface of ``--coordinator.routing`` (staleflow.coordinator.strategies.RoutingStrategy)."""

    def __init__(self, cfg, cost_model):
        self.cfg = cfg

    def choose(
        self, traj: TrajFacts, traj_version: int | None, candidates: list[InstanceState], ctx
    ) -> InstanceState | None:
        """``traj``: the trajectory's record in the ledger, looked up by id (read it, never write it)."""
        record("MostFreeKV.choose")
        fits = [c for c in candidates if c.waiting == 0 and c.kv_tokens + traj.tokens <= c.kv_capacity]
        return max(fits, key=lambda c: (c.kv_capacity - c.kv_tokens, -c.instance), default=None)
