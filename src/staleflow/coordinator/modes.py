"""System modes: StaleFlow, the baselines named for the systems they reproduce, and protocol ablations.

A mode is data, never a separate loop: coordinator overrides (routing, pull, queue, migration,
partial rollout, batch barrier), staleness overrides (a fixed eta, no redundancy), the batch
protocol (protocol/: StaleFlow's per-trajectory StalenessManager or a peer's count-based rule),
and for the simulator how weights travel and whether rollout and training share the GPUs.
``apply_mode`` resolves the config sections ONCE (staleflow.config.resolve in the runtime,
sim/simulator.build in the simulator); ``protocol_for`` / ``build_protocol`` give the protocol.
docs/baselines.md names each peer's mechanism (module and function) and our deviations.

- ``staleflow``: waterfall routing, MLQ, status pull with partial rollout, migration, occupy exchange.
- ``verl-sync`` (alias ``sync``): veRL ``RayPPOTrainer.fit``; colocated, generate a batch of B groups
  (round-robin), train, update in place; eta 0.
- ``verl-one-step-off`` (alias ``one-step-off``): veRL ``OneStepOffRayTrainer.fit``; batch k+1 is
  generated with the weights before step k while step k trains; sync (broadcast) at batch boundaries.
- ``verl-fully-async``: veRL ``FullyAsyncRollouter`` / ``FullyAsyncTrainer``; streaming admission by
  the ``staleness_threshold`` window counter (s = eta, trigger_parameter_sync_step = 1), batches in
  completion order, every sync interrupts all in-flight work (partial rollout) and resumes it anywhere.
- ``areal``: AReaL ``StalenessManager.get_capacity`` admission, batches of the earliest-started
  completed groups, round-robin routing, pause-all + broadcast update with abort and same-server resume.
- ablations of the protocol: ``staleflow-no-exchange`` (no occupy exchange) and
  ``staleflow-simple-strategies`` (StaleFlow's protocol with least-loaded routing, FIFO queue, greedy
  pull and no migration: what this repository called "areal" before issue 15).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from staleflow.protocol import StalenessSpec, make_protocol


@dataclass(frozen=True)
class Mode:
    name: str
    protocol: str = "staleflow"
    """protocol.PROTOCOLS key."""
    coordinator: dict = field(default_factory=dict)
    staleness: dict = field(default_factory=dict)
    weight_sync: str = "ps"
    """ps: the trainer pushes to the Parameter Server, each instance pulls on its own (StaleFlow);
    broadcast: the trainer sends the weights to the instances that pull (NCCL broadcast in the peers);
    colocated: in-place update on the GPUs that also train."""
    colocated: bool = False
    exchange: bool = True
    peer: str = ""
    """The system it reproduces ('' for StaleFlow and its ablations)."""


_NO_REDUNDANCY = {"batch_redundancy": 0, "group_redundancy": 0, "straggler": "off"}
_VERL_BARRIER = {
    "routing": "round-robin",
    "pull": "idle",
    "migration": False,
    "mlq": False,
    "barrier": True,
    "interrupt_on_pull": False,
    "keep_kv_on_pull": False,
}
_PAUSE_ALL = {
    "routing": "round-robin",
    "pull": "pause-all",
    "mlq": False,
    "barrier": False,
    "interrupt_on_pull": True,
    "keep_kv_on_pull": False,
}
"""The peers clear the KV cache at every weight update (verl clear_kv_cache, AReaL pause_generation with
clear_cache): interrupted work re-prefills, nothing keeps its KV across a load."""
NEVER_MIGRATE = {"phi_wait": 1 << 30, "psi": 0.0}
"""Migration triggers that never fire (psi 0: the throughput-gap trigger is off; finite, so the run's
config checks accept it): loop-backs may go to any instance, nothing is moved actively."""

_MODES = [
    Mode("staleflow", coordinator={"barrier": False}),
    Mode(
        "verl-sync",
        coordinator=dict(_VERL_BARRIER),
        staleness={"eta": 0, **_NO_REDUNDANCY},
        weight_sync="colocated",
        colocated=True,
        peer="verl",
    ),
    Mode(
        "verl-one-step-off",
        coordinator=dict(_VERL_BARRIER),
        staleness={"eta": 1, **_NO_REDUNDANCY},
        weight_sync="broadcast",
        peer="verl",
    ),
    Mode(
        "verl-fully-async",
        "verl-fully-async",
        {**_PAUSE_ALL, "migration": True, **NEVER_MIGRATE},
        dict(_NO_REDUNDANCY),
        weight_sync="broadcast",
        peer="verl",
    ),
    Mode(
        "areal",
        "areal",
        {**_PAUSE_ALL, "migration": False},
        dict(_NO_REDUNDANCY),
        weight_sync="broadcast",
        peer="areal",
    ),
    Mode("staleflow-no-exchange", coordinator={"barrier": False}, exchange=False),
    Mode(
        "staleflow-simple-strategies",
        coordinator={
            "routing": "least-loaded",
            "pull": "greedy",
            "migration": False,
            "mlq": False,
            "barrier": False,
            "interrupt_on_pull": True,
            "keep_kv_on_pull": False,
        },
        staleness=dict(_NO_REDUNDANCY),
    ),
]
MODE_TABLE: dict[str, Mode] = {m.name: m for m in _MODES}
ALIASES = {"sync": "verl-sync", "one-step-off": "verl-one-step-off"}
"""Old names (kept: scripts and tests that launch ``--mode sync`` keep working)."""
MODES = tuple(MODE_TABLE)
BASELINES = ("verl-sync", "verl-one-step-off", "verl-fully-async", "areal")
ASYNC_BASELINES = ("verl-one-step-off", "verl-fully-async", "areal")


def check_mode(mode: str) -> str:
    """The canonical mode name (aliases resolved); a clear error for an unknown one."""
    name = ALIASES.get(mode, mode)
    if name not in MODE_TABLE:
        raise ValueError(
            f"--mode={mode!r} is unknown; choose one of: {', '.join(MODES)} "
            f"(aliases: {', '.join(f'{a}={b}' for a, b in ALIASES.items())})"
        )
    return name


def mode_of(mode: str) -> Mode:
    return MODE_TABLE[check_mode(mode)]


def mode_overrides(mode: str) -> dict[str, dict]:
    """{"coordinator": {field: value}, "staleness": {field: value}} that define `mode`."""
    m = mode_of(mode)
    return {"coordinator": dict(m.coordinator), "staleness": dict(m.staleness)}


def apply_mode(mode: str, coordinator_cfg, staleness_cfg=None):
    """Return (coordinator_cfg, staleness_cfg) with the mode's overrides applied (validated again).
    A peer knob set for a mode that has no such knob is a ConfigError naming the flag (peer_knobs), and
    so is --staleness.train-order drawn with a peer's mode (check_train_order)."""
    peer_knobs(mode, coordinator_cfg)
    if staleness_cfg is not None:
        check_train_order(mode, getattr(staleness_cfg, "train_order", "completion"))
    o = mode_overrides(mode)
    c = dataclasses.replace(coordinator_cfg, **o["coordinator"])
    s = dataclasses.replace(staleness_cfg, **o["staleness"]) if staleness_cfg is not None else None
    return c, s


PEER_OPTIONS = {
    "verl-fully-async": ("staleness_threshold", "trigger_sync_steps", "strict"),
    "areal": ("max_concurrent", "strict"),
}
"""The peers' own knobs a caller may set (the grid's peer search): verl's staleness_threshold s (a
fraction is allowed) and trigger_parameter_sync_step T; AReaL's max_concurrent_rollouts; and the
strict variant of either (drop and regenerate groups beyond eta)."""


PEER_FLAGS = {
    "staleness_threshold": ("staleness_threshold", None),
    "trigger_sync_steps": ("trigger_sync_steps", 1),
    "max_concurrent": ("max_concurrent_rollouts", 0),
    "strict": ("strict", False),
}
"""PEER_OPTIONS knob -> (CoordinatorConfig field, its unset value): --coordinator.staleness-threshold,
--coordinator.trigger-sync-steps, --coordinator.max-concurrent-rollouts, --coordinator.strict."""


def peer_knobs(mode: str, coordinator_cfg) -> dict:
    """The peer's knobs set as run flags on the coordinator section, as build_protocol takes them.

    >>> from staleflow.config import CoordinatorConfig
    >>> peer_knobs("verl-fully-async", CoordinatorConfig(staleness_threshold=0.0, trigger_sync_steps=3))
    {'staleness_threshold': 0.0, 'trigger_sync_steps': 3}
    """
    from staleflow.faults import ConfigError

    m = mode_of(mode)
    allowed = PEER_OPTIONS.get(m.protocol, ())
    out = {}
    for knob, (fld, unset) in PEER_FLAGS.items():
        v = getattr(coordinator_cfg, fld, unset)
        if v == unset and type(v) is type(unset):
            continue
        if knob not in allowed:
            owners = [k for k, opts in PEER_OPTIONS.items() if knob in opts]
            raise ConfigError(
                f"--coordinator.{fld.replace('_', '-')}={v!r} is a knob of --mode {' / '.join(owners)}, not of "
                f"--mode {mode}; drop the flag or choose one of those modes"
            )
        out[knob] = v
    return out


def check_train_order(mode: str, train_order: str) -> None:
    """ConfigError unless `train_order` is one `mode` has: the peers train in their own order (AReaL by start,
    verl by completion or in whole batches), so --staleness.train-order drawn is StaleFlow's (and its ablations')."""
    from staleflow.faults import ConfigError

    if train_order != "completion" and mode_of(mode).peer:
        raise ConfigError(
            f"--staleness.train-order={train_order!r} is an option of StaleFlow's protocol, not of --mode {mode} "
            f"(the peer keeps its own batch order); drop the flag or use --mode staleflow"
        )


def build_protocol(mode: str, spec: StalenessSpec, n_instances: int = 1, train_order: str = "completion", **peer):
    """The batch protocol of `mode` with the (resolved) staleness settings and the peer's knobs `peer`.

    verl fully-async gets staleness_threshold s = eta unless `peer` sets it: with one version per B
    groups its window admits (1 + s) B groups ahead of the trainer, the (eta + 1) B that AReaL's formula
    and StaleFlow's eta + 1 buffers allow (matched eta)."""
    m = mode_of(mode)
    bad = sorted(set(peer) - set(PEER_OPTIONS.get(m.protocol, ())))
    if bad:
        raise ValueError(
            f"mode {mode!r} has no option {', '.join(bad)}; its options: "
            f"{', '.join(PEER_OPTIONS.get(m.protocol, ())) or 'none'}"
        )
    check_train_order(mode, train_order)
    opts: dict = dict(peer)
    if m.protocol == "staleflow":
        opts["exchange"] = m.exchange
        opts["train_order"] = train_order
    elif m.protocol == "verl-fully-async":
        opts.setdefault("staleness_threshold", float(spec.eta))
        opts["n_instances"] = n_instances
    return make_protocol(m.protocol, spec, **opts)


def staleness_spec(staleness, version: int = 0) -> StalenessSpec:
    """The protocol's settings from the (resolved) --staleness section: B', N' from its redundancies."""
    s = staleness
    return StalenessSpec(s.eta, s.batch_size, s.batch_capacity, s.group_size, s.group_capacity, version)


def protocol_for(mode: str, staleness, version: int = 0, n_instances: int = 1, **peer):
    """The batch protocol of ``mode`` for a (resolved) --staleness section (its train order too), starting at
    ``version``."""
    return build_protocol(mode, staleness_spec(staleness, version), n_instances, staleness.train_order, **peer)


def check_protocol(mode: str, manager) -> None:
    """ValueError unless ``manager`` is ``mode``'s batch protocol (a free-form label is the caller's
    choice): a coordinator never swaps the protocol it is given (build it with protocol_for)."""
    if mode not in MODE_TABLE and mode not in ALIASES:
        return
    spec = getattr(manager, "spec", None)
    if not isinstance(spec, StalenessSpec):
        raise ValueError(
            f"the coordinator was given a {type(manager).__name__} without a StalenessSpec (.spec): build it with "
            f"staleflow.coordinator.modes.protocol_for({mode!r}, staleness)"
        )
    want = build_protocol(mode, spec)
    if type(want) is not type(manager) or getattr(want, "exchange", None) != getattr(manager, "exchange", None):
        raise ValueError(
            f"mode {mode!r} runs protocol {type(want).__name__}"
            f"{'' if getattr(want, 'exchange', True) else ' without the occupy exchange'}, but the "
            f"coordinator was given a {type(manager).__name__}: build it with "
            f"staleflow.coordinator.modes.protocol_for({mode!r}, staleness)"
        )
