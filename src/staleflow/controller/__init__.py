"""The controller: one loop, one ledger, shared by the real runtime and the simulator.

    loop = ControllerLoop(settings, coordinator, ledger, backend, workload)  # coordinator reads ledger.trajs
    loop.run()                                   # until --steps versions are trained (runtime and simulator)
    loop.run(until=lambda: saved, timeout_s=600, hold_training=True)  # a front end's wait: events keep flowing
    loop.view.version                            # what a front end reads (controller/view.py)

See controller/loop.py for the steps and docs/architecture.md for the path of one trajectory.
"""

from staleflow.controller.backend import Backend, Published, PullDone, Rewarded, TrainDone
from staleflow.controller.ledger import Group, Ledger, LedgerError, Traj
from staleflow.controller.loop import ControllerLoop
from staleflow.controller.types import LoopSettings, LoopTimeout, RewardsFailing, Stalled, StepRecord, Workload
from staleflow.controller.view import LoopView
from staleflow.trajectory import Finished, TrainGroup

__all__ = [
    "Backend",
    "ControllerLoop",
    "Finished",
    "Group",
    "Ledger",
    "LedgerError",
    "LoopSettings",
    "LoopTimeout",
    "LoopView",
    "PullDone",
    "Published",
    "Rewarded",
    "RewardsFailing",
    "Stalled",
    "StepRecord",
    "Traj",
    "TrainDone",
    "TrainGroup",
    "Workload",
]
