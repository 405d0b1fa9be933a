"""The PipelineRL peer (``pipelinerl``) and the rule added to hold it to StaleFlow's bound
(``pipelinerl-reserve``), one file: its admission and batch rule, its knobs and their search.

Peer: ServiceNow/PipelineRL at 58d3934 (docs/baselines.md has the paragraph, the sources and what is ours):
- in-flight weight update (``pipelinerl/vllm1.py`` ``WeightUpdateManager.receive_weight_update``: every engine
  ``pause_generation(mode="keep", clear_cache=False)``, the NCCL broadcast, ``resume_generation``): running
  requests keep their KV and continue under the new weights; all engines at once, after every optimizer step
  (``finetune.weight_update_interval`` 1), the trainer blocked during the broadcast (``finetune_loop.py``
  ``send_weight_update``). Here: the ``pause-all`` pull with ``keep_kv_on_pull`` (nothing interrupted);
- admission by the lag limit (``actor.py`` ``ActorLoop._run``): a new group may be submitted while
      submitted_groups < lag_groups + groups_per_update x (1 + versions seen),
  lag_groups = ceil(max_lag / attempts) (max_lag in samples), groups_per_update = B. It is an ADMISSION
  limit only: the trainer counts samples older than max_lag (``samples_too_old_to_train``) and trains them,
  so a straggler overtaken by later groups is trained beyond the lag: no per-trajectory bound;
- dispatch per rollout to the engine with the fewest active rollouts (``schedule_rollouts``; least-loaded
  routing here), at most ``llm_max_rollouts`` per engine (``--coordinator.max-concurrent``);
- batches: the first B completed groups, FIFO (``preprocess.py``, ``finetune/data.py``).

Held to the bound. PipelineRL's released code keeps no per-trajectory bound; two rules keep it:
- ``pipelinerl-reserve``: NeMo-RL's ``max_trajectory_age_steps`` (``nemo_rl/algorithms/async_utils.py``: a
  trajectory reserves its target step at its start and training waits for it), which is StaleFlow's own
  reservation protocol without the occupy exchange, on PipelineRL's engine side (the same mode otherwise);
- ``--peer.pipelinerl.strict``: a group that can no longer be trained within eta is dropped and its prompt
  regenerated (the grid's strict column, as for verl and AReaL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from staleflow.modes.base import Mode, PeerConfig, check, register_mode
from staleflow.modes.staleflow import NO_REDUNDANCY
from staleflow.protocol import StalenessManager
from staleflow.protocol.counted import CountedBuffer
from staleflow.protocol.types import ProtocolError, StalenessSpec

IN_FLIGHT_UPDATE = {
    "routing": "least-loaded",
    "pull": "pause-all",
    "mlq": False,
    "barrier": False,
    "interrupt_on_pull": True,
    "keep_kv_on_pull": True,
    "migration": False,
    "tail_lanes": False,
}
"""PipelineRL's engine side: every engine pauses at once for each update, keeps its requests and their KV, and
resumes them under the new weights (the trainer waits for the broadcast); least-loaded dispatch, nothing moves."""
LAG_GROUPS = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)
"""lag_groups of the search, in batches of B groups, scanned in this order (nominal eta: ceil of the value)."""


@dataclass(frozen=True)
class PipelineRLSettings:
    """--mode pipelinerl's own knobs (--peer.pipelinerl.<knob>)."""

    lag_groups: int = -1
    """PipelineRL's lag limit in groups, lag_groups = ceil(max_lag / attempts) (its max_lag is in samples):
    admission stops while submitted groups reach lag_groups + B x (1 + versions seen). -1: eta x B (the
    (eta + 1) B groups ahead of the trainer that StaleFlow's eta + 1 buffers allow). PipelineRL's own default
    (max_lag null: unbounded) is not modelled."""
    strict: bool = False
    """Drop and regenerate a group that can no longer be trained within eta (the rule added to hold the
    bound by dropping; the grid's strict column). Not PipelineRL's behaviour: it trains over-lag samples."""

    def __post_init__(self):
        check(self.lag_groups >= -1, "peer.pipelinerl.lag-groups", self.lag_groups, "must be >= 0 (or -1: eta x B)")


@register_mode("pipelinerl")
class PipelineRL(Mode):
    peer = "pipelinerl"
    coordinator = dict(IN_FLIGHT_UPDATE)
    staleness = dict(NO_REDUNDANCY)
    weight_sync = "broadcast"
    Settings = PipelineRLSettings

    def protocol(self, spec, settings, n_instances, train_order):
        lag = spec.eta * spec.batch_size if settings.lag_groups < 0 else settings.lag_groups
        return PipelineRLBuffer(spec, lag, settings.strict)

    def families(self, batch_size):
        """lag_groups 0, B/4, B/2, ... (ascending: the worst case grows with it)."""
        return [[config(x, batch_size) for x in LAG_GROUPS]]

    def nominal(self, eta, batch_size):
        return [config(float(eta), batch_size)]

    def strict(self, eta, batch_size):
        return [config(float(eta), batch_size, strict_eta=eta)]


@register_mode("pipelinerl-reserve")
class PipelineRLReserve(Mode):
    """PipelineRL's engine side with NeMo-RL's per-trajectory rule: bounded at eta by construction."""

    peer = "pipelinerl"
    coordinator = dict(IN_FLIGHT_UPDATE)
    staleness = dict(NO_REDUNDANCY)
    weight_sync = "broadcast"

    def protocol(self, spec, settings, n_instances, train_order):
        return StalenessManager(spec, exchange=False, train_order="completion")

    def families(self, batch_size):
        """One configuration per bound (each qualifies for its eta and every larger one)."""
        return [[PeerConfig(self.name, e, label=f"{self.name} eta={e}") for e in (1, 2, 3)]]

    def reduced_families(self, max_eta):
        return [[PeerConfig(self.name, e, label=f"{self.name} eta={e}") for e in range(1, max_eta + 1)]]


def config(lag_batches: float, batch_size: int, strict_eta: int = -1) -> PeerConfig:
    """One PipelineRL configuration: a lag of ``lag_batches`` x B groups; ``strict_eta`` >= 0: the strict
    variant at that eta."""
    peer = [("lag_groups", int(round(lag_batches * batch_size)))]
    if strict_eta >= 0:
        peer.append(("strict", True))
    eta = strict_eta if strict_eta >= 0 else max(0, math.ceil(round(lag_batches, 6)))
    label = f"pipelinerl lag={lag_batches:g}B" + (" strict" if strict_eta >= 0 else "")
    return PeerConfig("pipelinerl", eta, tuple(peer), (), label)


class PipelineRLBuffer(CountedBuffer):
    """m = PipelineRLBuffer(StalenessSpec(eta=1, batch_size=2), lag_groups=2)  # 2 + 2 groups before an update"""

    def __init__(self, spec: StalenessSpec, lag_groups: int, strict: bool = False):
        super().__init__(spec, strict)
        if type(lag_groups) is not int or lag_groups < 0:
            raise ProtocolError(f"PipelineRLBuffer lag_groups={lag_groups!r} must be an int >= 0")
        self.lag_groups = lag_groups
        self.submitted = spec.version * spec.batch_size  # a resumed run: the groups its trainer consumed
        self.active = 0

    def _budget(self) -> int:
        return self.lag_groups + self.batch_size * (self.rollout_version + 1)

    def _room(self, traj_version: int) -> bool:
        return self.submitted < self._budget()

    def _admitted(self, g) -> None:
        self.submitted += 1
        self.active += 1

    def _left(self, g, completed: bool) -> None:
        self.active -= 1
        if not completed:
            self.submitted -= 1  # strict variant: a dropped over-stale group gives its place to its retry

    def _unqueued(self, g) -> None:
        self.submitted -= 1

    def _batch(self, queue: list) -> list:
        return queue[: self.batch_size]

    def _counters(self) -> dict:
        return {"submitted": self.submitted, "budget": self._budget(), "active": self.active}

    def validate(self) -> None:
        super().validate()
        active = sum(1 for g in self._groups.values() if not g.occupied)
        if active != self.active:
            raise ProtocolError(f"PipelineRLBuffer active={self.active} but {active} groups are in flight")
