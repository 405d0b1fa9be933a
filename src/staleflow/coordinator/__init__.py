"""The staleness-aware coordinator (Snapshot-Command cycle), its strategies and the cost model.

Pure: no torch, no sockets. The real controller and the simulator (staleflow.sim) drive the
same ``Coordinator``; see docs/coordinator.md.
"""

from staleflow.coordinator.coordinator import Coordinator
from staleflow.coordinator.cost_model import CostModel, CostModelError, fit_cost_model, load_cost_model
from staleflow.coordinator.mlq import MultiLevelQueue
from staleflow.coordinator.modes import BASELINES, MODES, apply_mode, build_protocol, mode_of, mode_overrides
from staleflow.coordinator.strategies import PULL, ROUTING, register_pull, register_routing
from staleflow.coordinator.types import Abort, Command, InstanceSnapshot, Interrupt, Pull, TrajFacts
from staleflow.trajectory import Route

__all__ = [
    "Abort",
    "BASELINES",
    "Command",
    "Coordinator",
    "CostModel",
    "CostModelError",
    "InstanceSnapshot",
    "Interrupt",
    "MODES",
    "MultiLevelQueue",
    "PULL",
    "Pull",
    "ROUTING",
    "Route",
    "TrajFacts",
    "apply_mode",
    "build_protocol",
    "fit_cost_model",
    "mode_of",
    "load_cost_model",
    "mode_overrides",
    "register_pull",
    "register_routing",
]
