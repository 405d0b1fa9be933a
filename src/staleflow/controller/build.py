"""The one place a controller loop is wired: the mode's batch protocol, the coordinator, the
ledger and the loop, from the same (resolved) config sections, for the runtime and the simulator.

    loop = build_loop("staleflow", staleness, coordinator_cfg, cost_model, instances=[0, 1],
                      backend=backend, workload=workload, steps=20)

The runtime (runtime/job.py) passes its ranks' backend, the dataset and the run's version
(resume); the simulator (sim/simulator.py) its simulated backend, clock and tick. Nothing else
builds a protocol or a coordinator for a run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from staleflow.controller.ledger import Ledger
from staleflow.controller.loop import ControllerLoop
from staleflow.controller.types import LoopSettings, StepRecord
from staleflow.coordinator.coordinator import Coordinator
from staleflow.modes import mode_of, mode_settings, protocol_for


def build_loop(
    mode: str,
    staleness,
    coordinator_cfg,
    cost_model,
    instances: Iterable[int],
    backend,
    workload,
    steps: int,
    *,
    version: int = 0,
    ledger: Ledger | None = None,
    tick_s: float | None = None,
    stall_s: float = math.inf,
    max_reward_failures: int = 0,
    refill_groups: int = 0,
    peer: Any = None,
    on_step: Callable[[StepRecord, dict], None] | None = None,
    listeners: Mapping[type, Callable[[Any], None]] | None = None,
    counts: Mapping[str, int] | None = None,
    requeue: Iterable = (),
) -> ControllerLoop:
    """A ControllerLoop for ``mode`` (its protocol from ``staleness``: B', N' and eta; the sections
    arrive with the mode applied, config.resolve / modes.apply_mode). ``peer``: the mode's own settings,
    as the run's --peer section (RunConfig.peer) or a mapping of its knobs (the simulator's search;
    None: its defaults); ``tick_s`` overrides the coordinator's
    --coordinator.tick-ms (the simulator's timing resolution); ``counts``, ``requeue``: a resumed run's
    counters and the prompts in flight at its checkpoint (ControllerLoop)."""
    ids = list(instances)
    ledger = Ledger() if ledger is None else ledger
    settings = mode_settings(mode, peer)
    manager = protocol_for(mode, staleness, version=version, n_instances=len(ids), peer=settings)
    coord = Coordinator(
        coordinator_cfg,
        cost_model,
        manager,
        ids,
        trajs=ledger.trajs,  # the one per-trajectory table: the coordinator looks trajectories up in it by id
        straggler=staleness.straggler,
        straggler_threshold=staleness.straggler_threshold,
        version=version,
        clock=backend.now,
        label=mode,
        sync_every=mode_of(mode).publish_every(settings),
    )
    settings = LoopSettings.from_config(
        coordinator_cfg, steps, stall_s=stall_s, max_reward_failures=max_reward_failures
    )
    if tick_s is not None:
        settings = dataclasses.replace(settings, tick_s=tick_s)
    settings = dataclasses.replace(settings, refill_groups=refill_groups)
    return ControllerLoop(
        settings,
        coord,
        ledger,
        backend,
        workload,
        version=version,
        on_step=on_step,
        listeners=listeners,
        counts=counts,
        requeue=requeue,
    )
