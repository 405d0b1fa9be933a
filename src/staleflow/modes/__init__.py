"""The systems a run can be (``--mode``): StaleFlow, its ablations and the peers it is compared with, as
registered modes, pure (no torch, no I/O).

    from staleflow.modes import MODES, Mode, register_mode, mode_of, apply_mode, protocol_for
    apply_mode("areal", coordinator_cfg, staleness_cfg)   # the sections with the mode's overrides (config.resolve)
    protocol_for("areal", staleness, peer=cfg.peer)        # its batch protocol (controller/build.py)
    mode_of("areal").families(batch_size)                  # its knob search (sim/search.py)

One file per system (staleflow.py: StaleFlow and its ablations; verl.py; areal.py; pipelinerl.py), each registering its
modes; the line below lists them: a new peer is one file plus its name here (a fork's: one file, named
by import path, ``--mode my_pkg.peer:MyPeer``; docs/extending.md). ``PeerSettings`` is the ``--peer``
flag section, composed from the registered modes' own Settings (``--peer.areal.max-concurrent-rollouts 8``).
docs/baselines.md names each peer's mechanism (module and function) and our deviations.
"""

import dataclasses

from staleflow.modes import areal, pipelinerl, staleflow, verl  # noqa: F401  (each registers its modes, in this order)
from staleflow.modes.base import (
    MODES,
    Mode,
    PeerConfig,
    apply_mode,
    async_peers,
    build_protocol,
    check_mode,
    check_protocol,
    check_train_order,
    field_name,
    mode_of,
    mode_settings,
    peers,
    protocol_for,
    register_mode,
    staleness_spec,
)


def _peer_section():
    """The --peer section: one sub-section per registered mode that has Settings (built once, at import)."""
    fields = [
        (field_name(name), cls.Settings, dataclasses.field(default_factory=cls.Settings))
        for name, cls in MODES.items()
        if cls.Settings is not None
    ]
    doc = "Each peer's own knobs (--peer.<mode>.<knob>); only the run's --mode may set its own (docs/baselines.md)."
    cls = dataclasses.make_dataclass("PeerSettings", fields, frozen=True, namespace={"__doc__": doc})
    cls.__module__ = __name__  # (make_dataclass's module= is Python 3.12+)
    return cls


PeerSettings = _peer_section()

__all__ = [
    "MODES",
    "Mode",
    "PeerConfig",
    "PeerSettings",
    "apply_mode",
    "async_peers",
    "build_protocol",
    "check_mode",
    "check_protocol",
    "check_train_order",
    "field_name",
    "mode_of",
    "mode_settings",
    "peers",
    "protocol_for",
    "register_mode",
    "staleness_spec",
]
