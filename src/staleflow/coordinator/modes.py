"""System modes: StaleFlow and the baselines as settings of the same coordinator (never separate code).

- ``staleflow``: every strategy as configured (waterfall + MLQ + dynamic tags, status pull with
  partial rollout, migration, redundancy, straggler handling).
- ``areal`` (AReaL): count-based admission with eta (here the same per-trajectory reservations:
  a group is admitted iff a buffer in its window has room, so at most (eta + 1) * B groups are
  ahead of the trainer), least-loaded routing over a FIFO queue, greedy pull that interrupts all
  in-flight work at every weight update (partial rollout: interrupted work is resubmitted with
  its tokens), no migration, no redundancy.
- ``one-step-off`` (veRL one_step_off_policy): disaggregated; batch k+1 is generated with the
  weights from before training step k (batch-level eta = 1): a whole batch of B groups is
  dispatched at a barrier (least-loaded), weights are pulled at batch boundaries only (nothing
  in flight, so nothing is interrupted).
- ``sync`` (veRL colocated/HybridFlow): eta = 0, same barrier; the simulator also colocates the
  trainer on the rollout GPUs (generate a batch on all GPUs, then train on all GPUs).

``mode_overrides(mode)`` gives the field overrides per config section so the real runtime and
the simulator build the mode the same way; ``apply_mode`` applies them to config objects.
"""

from __future__ import annotations

import dataclasses

MODES = ("staleflow", "areal", "one-step-off", "sync")

_BARRIER = {"routing": "least-loaded", "pull": "idle", "migration": False, "mlq": False, "barrier": True,
            "interrupt_on_pull": False}
_NO_REDUNDANCY = {"batch_redundancy": 0, "group_redundancy": 0, "straggler": "off"}

_OVERRIDES: dict[str, dict[str, dict]] = {
    "staleflow": {"coordinator": {"barrier": False}, "staleness": {}},
    "areal": {"coordinator": {"routing": "least-loaded", "pull": "greedy", "migration": False, "mlq": False,
                              "barrier": False, "interrupt_on_pull": True},
              "staleness": dict(_NO_REDUNDANCY)},
    "one-step-off": {"coordinator": dict(_BARRIER), "staleness": {"eta": 1, **_NO_REDUNDANCY}},
    "sync": {"coordinator": dict(_BARRIER), "staleness": {"eta": 0, **_NO_REDUNDANCY}},
}

COLOCATED = {"sync": True, "areal": False, "one-step-off": False, "staleflow": False}
"""Whether the mode runs rollout and training on the same GPUs, one after the other."""

WEIGHT_SYNC = {"staleflow": "ps", "areal": "broadcast-pause", "one-step-off": "broadcast", "sync": "colocated"}
"""How new weights reach the instances in each system: ps = trainer pushes to the Parameter Server,
each instance pulls on its own (StaleFlow); broadcast-pause = the trainer broadcasts to every
instance while all of them pause (AReaL: pause, update, resume); broadcast = broadcast at the batch
boundary (veRL one-step-off); colocated = in-place update on the same GPUs (veRL sync)."""


def check_mode(mode: str) -> str:
    if mode not in _OVERRIDES:
        raise ValueError(f"--mode={mode!r} is unknown; choose one of: {', '.join(MODES)}")
    return mode


def mode_overrides(mode: str) -> dict[str, dict]:
    """{"coordinator": {field: value}, "staleness": {field: value}} that define `mode`."""
    check_mode(mode)
    return {k: dict(v) for k, v in _OVERRIDES[mode].items()}


def apply_mode(mode: str, coordinator_cfg, staleness_cfg=None):
    """Return (coordinator_cfg, staleness_cfg) with the mode's overrides applied (validated again)."""
    o = mode_overrides(mode)
    c = dataclasses.replace(coordinator_cfg, **o["coordinator"])
    s = dataclasses.replace(staleness_cfg, **o["staleness"]) if staleness_cfg is not None else None
    return c, s
