"""What a mode is, its registry, and the helpers that resolve one for a run (runtime and simulator alike).

A mode is everything that makes one system differ from another on the shared loop, in one class: the
batch protocol it builds (protocol/: StaleFlow's StalenessManager or a peer's count-based rule), the
coordinator overrides (routing, pull policy, queue, migration, partial rollout, batch barrier), the
staleness overrides (a fixed eta, no redundancy), its own settings (a frozen dataclass: the flag section
``--peer.<mode>.<knob>``), its knob-search families for the simulator's guarantee-matched peer search,
and for the simulator how weights travel and whether rollout and training share the GPUs. ``MODES`` is
the one registry (extensions.Registry, like engines and losses): a built-in registers itself with
``@register_mode("name")`` in its own file, listed once in modes/__init__.py; a fork's mode is named by
import path (``--mode my_pkg.peer:MyPeer``), through the same checks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from staleflow.extensions import ExtensionError, Registry, Shape, one_line
from staleflow.faults import ConfigError
from staleflow.protocol import StalenessManager, StalenessSpec


@dataclass(frozen=True)
class PeerConfig:
    """One configuration of a peer for the simulator's search: the mode, its nominal eta, its settings'
    knobs and coordinator overrides (sim/search.py runs families of these)."""

    mode: str
    eta: int
    peer: tuple = ()
    """((knob, value), ...): fields of the mode's Settings."""
    overrides: tuple = ()
    """((field, value), ...) coordinator overrides (partial_rollout=False: interrupt_on_pull False)."""
    label: str = ""

    def args(self) -> tuple[str, int, dict, dict]:
        return self.mode, self.eta, dict(self.overrides), dict(self.peer)


class Mode:
    """Base class of a mode (docs/extending.md, "A new peer baseline"). Subclass it, set what differs
    from StaleFlow's defaults below, and override ``protocol`` for a peer's own batch rule."""

    name = ""
    """The name it is registered under (set by register_mode; a fork's: its import path)."""
    peer = ""
    """The system it reproduces ('' for StaleFlow and its ablations)."""
    aliases: tuple = ()
    """Other names ``--mode`` accepts for it."""
    coordinator: dict = {}
    """CoordinatorConfig fields it sets (routing, pull, mlq, migration, interrupt_on_pull, barrier, ...)."""
    staleness: dict = {}
    """StalenessConfig fields it sets (a fixed eta, no redundancy)."""
    weight_sync = "ps"
    """ps: the trainer pushes to the Parameter Server, each instance pulls on its own (StaleFlow); broadcast:
    the trainer sends the weights to the instances that pull (NCCL broadcast in the peers); colocated:
    in-place update on the GPUs that also train (the simulator's model of verl's hybrid engine)."""
    colocated = False
    fixed_eta = -1
    """The only eta it runs at (verl-sync 0, verl-one-step-off 1); -1: any."""
    Settings = None
    """Its own knobs: a frozen dataclass (validated in __post_init__), the flag section --peer.<name>.<knob>;
    None: it has none."""

    def protocol(self, spec: StalenessSpec, settings, n_instances: int, train_order: str):
        """The batch protocol of a run (protocol/interface.py's BatchProtocol) from the resolved staleness
        settings, its own settings and the number of rollout instances."""
        return StalenessManager(spec, train_order=train_order)

    def publish_every(self, settings) -> int:
        """Instances pull every this many published versions (verl's trigger_parameter_sync_step T)."""
        return 1

    def families(self, batch_size: int) -> list[list[PeerConfig]]:
        """Its knob-search families (sim/search.py), each in ascending order of the knob that raises the
        worst case; a fixed-eta peer: its one configuration."""
        if self.peer and self.fixed_eta >= 0:
            return [[PeerConfig(self.name, self.fixed_eta, label=self.name)]]
        return []

    def reduced_families(self, max_eta: int) -> list[list[PeerConfig]]:
        """Its families in the grid's reduced search (the 1024-GPU setting): none unless it says so."""
        return []

    def nominal(self, eta: int, batch_size: int) -> list[PeerConfig]:
        """Its configurations at the same NOMINAL eta (the grid's secondary column)."""
        return []

    def strict(self, eta: int, batch_size: int) -> list[PeerConfig]:
        """Its strict variants at nominal eta (groups beyond eta dropped and regenerated)."""
        return []

    def settings(self, **knobs):
        """Its Settings with ``knobs`` set (None when it has none); ConfigError naming a knob it lacks."""
        fields = [f.name for f in dataclasses.fields(self.Settings)] if self.Settings is not None else []
        bad = sorted(set(knobs) - set(fields))
        if bad:
            raise ConfigError(
                f"mode {self.name!r} has no option {', '.join(bad)}; its options: {', '.join(fields) or 'none'}"
            )
        return None if self.Settings is None else self.Settings(**knobs)


MODES: Registry[type[Mode]] = Registry(
    "mode",
    "--mode",
    Shape.klass(
        0,
        "a Mode subclass (staleflow.modes.Mode) with protocol(spec, settings, n_instances, train_order), "
        "families(batch_size), nominal(eta, batch_size), strict(eta, batch_size) and its class attributes",
        methods=(("protocol", 4), ("publish_every", 1), ("families", 1), ("nominal", 2), ("strict", 2)),
        attrs=(("peer", str), ("coordinator", dict), ("staleness", dict), ("weight_sync", str), ("fixed_eta", int)),
    ),
)
"""name -> mode class, in registration order (StaleFlow and its ablations, then the peers)."""


def register_mode(name: str):
    """Decorator: make a Mode subclass available as ``--mode NAME`` (checked against the interface now)."""

    def deco(cls):
        cls.name = name
        MODES[name] = cls
        return cls

    return deco


_INSTANCES: dict[str, Mode] = {}


def registered(mode: str) -> str | None:
    """The registered name ``mode`` names (itself or an alias), else None (no import: a plain lookup)."""
    for name, cls in MODES.items():
        if mode == name or mode in cls.aliases:
            return name
    return None


def unknown_mode(mode: str) -> ConfigError:
    aliases = ", ".join(f"{a}={n}" for n, c in MODES.items() for a in c.aliases)
    return ConfigError(
        f"--mode={mode!r}: choose one of {', '.join(MODES)} (aliases: {aliases}), or a fork's "
        f"'package.module:Class' (docs/extending.md)"
    )


def check_mode(mode: str) -> str:
    """The canonical mode name (aliases resolved; a fork's import path as given); ConfigError for an unknown one."""
    name = registered(mode)
    if name is not None:
        return name
    if ":" in mode:
        mode_of(mode)  # import and check it now: the error names the flag
        return mode
    raise unknown_mode(mode)


def mode_of(mode: str) -> Mode:
    """The mode (an instance of its class) a registered name, an alias or an import path names."""
    m = _INSTANCES.get(mode)
    if m is not None:
        return m
    name = mode if ":" in mode else check_mode(mode)
    cls = MODES.resolve(name)
    try:
        m = cls()
    except Exception as e:  # a fork's class may raise anything; the message names the flag
        raise ExtensionError(f"--mode={mode!r}: {cls.__name__}() failed ({type(e).__name__}: {one_line(e)})") from None
    m.name = name
    _INSTANCES[mode] = _INSTANCES[name] = m
    return m


def peers() -> list[Mode]:
    """Every registered peer, in registration order."""
    return [mode_of(n) for n, c in MODES.items() if c.peer]


def async_peers() -> list[str]:
    """Names of the registered peers that train on stale data (every peer but the synchronous ones)."""
    return [m.name for m in peers() if m.fixed_eta != 0]


def field_name(mode: str) -> str:
    """The mode's field in the --peer section: 'verl-fully-async' -> 'verl_fully_async'."""
    return mode.replace("-", "_")


def mode_settings(mode: str, peer=None):
    """The mode's Settings for a run: ``peer`` None (defaults), its Settings as they are, a --peer section (its
    own sub-section) or a mapping of knobs (the simulator's search)."""
    m = mode_of(mode)
    if peer is None:
        return m.settings()
    if m.Settings is not None and isinstance(peer, m.Settings):
        return peer
    if isinstance(peer, Mapping):
        return m.settings(**peer)
    own = getattr(peer, field_name(m.name), None)
    return own if own is not None else m.settings()


def check_peer_section(mode: str, peer) -> None:
    """ConfigError for a knob set in another mode's --peer section: a run has one mode, and a knob of
    another one would silently do nothing."""
    name = mode_of(mode).name
    for f in dataclasses.fields(peer):
        if f.name == field_name(name):
            continue
        given, default = getattr(peer, f.name), f.default_factory()
        for k in dataclasses.fields(given):
            v = getattr(given, k.name)
            if v != getattr(default, k.name):
                flag = f"--peer.{f.name.replace('_', '-')}.{k.name.replace('_', '-')}"
                raise ConfigError(
                    f"{flag}={v!r} is a knob of --mode {f.name.replace('_', '-')}, not of --mode {mode}; drop the "
                    f"flag or choose that mode"
                )


def check_train_order(mode: str, train_order: str) -> None:
    """ConfigError unless `train_order` is one `mode` has: the peers train in their own order (AReaL by start,
    verl by completion or in whole batches), so --staleness.train-order drawn is StaleFlow's (and its ablations')."""
    if train_order != "completion" and mode_of(mode).peer:
        raise ConfigError(
            f"--staleness.train-order={train_order!r} is an option of StaleFlow's protocol, not of --mode {mode} "
            f"(the peer keeps its own batch order); drop the flag or use --mode staleflow"
        )


def apply_mode(mode: str, coordinator_cfg, staleness_cfg=None, peer=None):
    """(coordinator_cfg, staleness_cfg) with the mode's overrides applied (validated again). ``peer``: the run's
    --peer section, checked (a knob of another mode is a ConfigError naming the flag); so is
    --staleness.train-order drawn with a peer's mode."""
    m = mode_of(mode)
    if peer is not None:
        check_peer_section(mode, peer)
    if staleness_cfg is not None:
        check_train_order(mode, getattr(staleness_cfg, "train_order", "completion"))
    c = dataclasses.replace(coordinator_cfg, **m.coordinator)
    s = dataclasses.replace(staleness_cfg, **m.staleness) if staleness_cfg is not None else None
    return c, s


def staleness_spec(staleness, version: int = 0) -> StalenessSpec:
    """The protocol's settings from the (resolved) --staleness section: B', N' from its redundancies."""
    s = staleness
    return StalenessSpec(s.eta, s.batch_size, s.batch_capacity, s.group_size, s.group_capacity, version)


def build_protocol(mode: str, spec: StalenessSpec, n_instances: int = 1, train_order: str = "completion", peer=None):
    """The batch protocol of `mode` with the (resolved) staleness settings and its settings (``peer``:
    mode_settings' forms)."""
    check_train_order(mode, train_order)
    return mode_of(mode).protocol(spec, mode_settings(mode, peer), n_instances, train_order)


def protocol_for(mode: str, staleness, version: int = 0, n_instances: int = 1, peer=None):
    """The batch protocol of ``mode`` for a (resolved) --staleness section (its train order too), from ``version``."""
    return build_protocol(mode, staleness_spec(staleness, version), n_instances, staleness.train_order, peer)


def check_protocol(mode: str, manager) -> None:
    """ValueError unless ``manager`` is ``mode``'s batch protocol (a label that names no mode is the caller's
    choice): a coordinator never swaps the protocol it is given (build it with protocol_for)."""
    if ":" not in mode and registered(mode) is None:
        return
    spec = getattr(manager, "spec", None)
    if not isinstance(spec, StalenessSpec):
        raise ValueError(
            f"the coordinator was given a {type(manager).__name__} without a StalenessSpec (.spec): build it with "
            f"staleflow.modes.protocol_for({mode!r}, staleness)"
        )
    want = build_protocol(mode, spec)
    if type(want) is not type(manager) or getattr(want, "exchange", None) != getattr(manager, "exchange", None):
        raise ValueError(
            f"mode {mode!r} runs protocol {type(want).__name__}"
            f"{'' if getattr(want, 'exchange', True) else ' without the occupy exchange'}, but the "
            f"coordinator was given a {type(manager).__name__}: build it with "
            f"staleflow.modes.protocol_for({mode!r}, staleness)"
        )


def check(ok: bool, flag: str, value, need: str) -> None:
    """A mode's Settings check: ConfigError '--peer.<mode>.<knob>=VALUE is invalid: NEED' (config/sections' form)."""
    if not ok:
        raise ConfigError(f"--{flag}={value!r} is invalid: {need}")


def nominal_eta(s: float, T: int = 1) -> int:
    """A window admitting (1 + s) T batches ahead of the trainer reaches staleness ceil((1 + s) T) - 1."""
    return max(0, math.ceil(round((1 + s) * T, 6)) - 1)
