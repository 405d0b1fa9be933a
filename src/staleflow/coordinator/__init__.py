"""The staleness-aware coordinator (Snapshot-Command cycle), its strategies and the cost model.

Pure: no torch, no sockets. The real controller and the simulator (staleflow.sim) drive the
same ``Coordinator``; see docs/coordinator.md. The modes (StaleFlow, its ablations, the peers) are
staleflow.modes.
"""

from staleflow.coordinator.coordinator import Coordinator
from staleflow.coordinator.cost_model import CostModel, CostModelError, fit_cost_model, load_cost_model
from staleflow.coordinator.mlq import MultiLevelQueue
from staleflow.coordinator.record import SchedRecord, Schedule
from staleflow.coordinator.strategies import PLANNERS, PULL, ROUTING, register_planner, register_pull, register_routing
from staleflow.coordinator.types import Abort, Command, InstanceSnapshot, Interrupt, Pull, TrajFacts
from staleflow.coordinator.view import CoordinatorView
from staleflow.trajectory import Route

__all__ = [
    "Abort",
    "Command",
    "Coordinator",
    "CoordinatorView",
    "CostModel",
    "CostModelError",
    "InstanceSnapshot",
    "Interrupt",
    "MultiLevelQueue",
    "PLANNERS",
    "PULL",
    "Pull",
    "ROUTING",
    "Route",
    "SchedRecord",
    "Schedule",
    "TrajFacts",
    "fit_cost_model",
    "load_cost_model",
    "register_planner",
    "register_pull",
    "register_routing",
]
