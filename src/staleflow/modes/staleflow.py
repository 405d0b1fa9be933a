"""StaleFlow's own mode and its protocol ablations.

- ``staleflow``: waterfall routing, MLQ, status pull with partial rollout, migration, occupy exchange
  (the CoordinatorConfig defaults; StaleFlow's per-trajectory StalenessManager).
- ``staleflow-no-exchange``: the same without the occupy exchange.
- ``staleflow-simple-strategies``: StaleFlow's protocol with least-loaded routing, a FIFO queue, greedy pull
  and no migration (what this repository called "areal" before issue 15).
"""

from __future__ import annotations

from staleflow.modes.base import Mode, register_mode
from staleflow.protocol import StalenessManager

NO_REDUNDANCY = {"batch_redundancy": 0, "group_redundancy": 0, "straggler": "off"}


@register_mode("staleflow")
class StaleFlow(Mode):
    coordinator = {"barrier": False}


@register_mode("staleflow-no-exchange")
class StaleFlowNoExchange(Mode):
    coordinator = {"barrier": False}

    def protocol(self, spec, settings, n_instances, train_order):
        return StalenessManager(spec, exchange=False, train_order=train_order)


@register_mode("staleflow-simple-strategies")
class StaleFlowSimpleStrategies(Mode):
    coordinator = {
        "routing": "least-loaded",
        "pull": "greedy",
        "migration": False,
        "mlq": False,
        "barrier": False,
        "interrupt_on_pull": True,
        "keep_kv_on_pull": False,
        "tail_lanes": False,
    }
    staleness = dict(NO_REDUNDANCY)
