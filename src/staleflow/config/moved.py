"""Keys that a later version moved, and where each went: a saved run's config.json (``--resume``) is
upgraded so that a value the run was started with keeps its meaning, and a ``--config`` file naming an
old key is told the new flag. A saved key that no version knows is refused by the reader (never dropped:
dropping it would resume the run with another setting than it was started with).

    upgrade({"mode": "areal", "coordinator": {"max_concurrent_rollouts": 8, ...}})
    -> ({"mode": "areal", "coordinator": {...}, "peer": {"areal": {"max_concurrent_rollouts": 8}}},
        ["coordinator.max-concurrent-rollouts moved to --peer.areal.max-concurrent-rollouts"])
"""

from __future__ import annotations

import copy

from staleflow.modes.base import field_name

PEER = "{peer}"  # the saved --mode's own --peer section (modes/base.field_name)

MOVED: dict[str, str] = {
    # 2026-12-07, peers as registered modes (commit e06a2d0): the peers' knobs left --coordinator
    "coordinator.staleness_threshold": "peer.verl_fully_async.staleness_threshold",
    "coordinator.trigger_sync_steps": "peer.verl_fully_async.trigger_sync_steps",
    "coordinator.max_concurrent_rollouts": "peer.areal.max_concurrent_rollouts",
    "coordinator.strict": f"peer.{PEER}.strict",
}
"""Old dotted key (underscores, as in config.json) -> new dotted key."""

DEFAULT_IF_UNPLACED = {"coordinator.strict": False}
"""Moved keys whose target depends on the mode: this value means nothing for a mode without the target
(StaleFlow's own modes had no use for it), so it is dropped there; any other value is refused."""


def flag(dotted: str) -> str:
    """'peer.areal.max_concurrent_rollouts' -> '--peer.areal.max-concurrent-rollouts'."""
    return "--" + dotted.replace("_", "-")


def target(old: str, mode: str) -> str | None:
    """Where an old key went for a run of this mode; None when it did not move (or the mode has no such
    section)."""
    new = MOVED.get(old)
    if new is None:
        return None
    return new.replace(PEER, field_name(mode)) if PEER in new else new


def hint(old: str) -> str:
    """' (moved to --peer.areal.max-concurrent-rollouts)' for a moved key, else ''."""
    new = MOVED.get(old)
    return f" (moved to {flag(new.replace(PEER, '<mode>'))})" if new else ""


_MISSING = object()


def _lookup(tree: dict, dotted: str):
    """The value at a dotted key of a nested dict, or _MISSING."""
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def upgrade(saved: dict, defaults: dict) -> tuple[dict, list[str]]:
    """(a copy of a saved config dict with each moved key put where it went, notes on the moved values
    that differ from today's default). `defaults` is the current default config as a nested dict
    (dataclasses.asdict), which says whether a target exists."""
    out, notes = copy.deepcopy(saved), []
    mode = saved.get("mode") if isinstance(saved.get("mode"), str) else ""
    for old in MOVED:
        head, key = old.rsplit(".", 1)
        section = out.get(head)
        if not isinstance(section, dict) or key not in section:
            continue
        new = target(old, mode)
        default = _MISSING if new is None else _lookup(defaults, new)
        if default is _MISSING or isinstance(default, dict):
            if old in DEFAULT_IF_UNPLACED and section[key] == DEFAULT_IF_UNPLACED[old]:
                del section[key]
            continue  # left in place: the reader refuses it, naming the key
        value = section.pop(key)
        node = out
        for part in new.split(".")[:-1]:
            node = node.setdefault(part, {})
        node.setdefault(new.rsplit(".", 1)[-1], value)
        if value != default:
            notes.append(f"{flag(old)[2:]} {value!r} moved to {flag(new)}")
    return out, notes
