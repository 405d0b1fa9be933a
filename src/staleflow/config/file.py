"""A run's flags as a file: ``--config run.yaml`` (or ``.toml``) and the resolved config a run writes.

    base = apply_dict(preset_cfg, {"train": {"lr": 2e-5}}, "run.yaml")   # file values over the preset
    text = dump_yaml(cfg)                                                 # what runs/X/config.yaml holds
    text = dump_toml(cfg)                                                 # runs/X/config.toml: the same

Keys are the flag names without ``--`` nested by section (``rollout: {max_new_tokens: 64}``;
dashes or underscores, as on the command line; a dotted key ``rollout.max-new-tokens: 64`` works
too). Flags given on the command line win over the file (the file's values become the defaults
tyro parses the command line against). ``preset: NAME`` in a file picks the preset the file's
values apply to (``--preset`` on the command line wins). Values are checked against the field's
type here and by each section's ``__post_init__``; an unknown key is a one-line ConfigError.
Pure: the caller reads the file (config/parse.py).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from staleflow.config.moved import hint as moved_hint
from staleflow.config.sections import ConfigError

MAX_CONFIG_BYTES = 1 << 20
"""A --config file larger than this is refused unread (a file of flags is a few KB)."""
MAX_CONFIG_VALUES = 100_000
"""Values a --config file may hold once YAML's aliases are expanded."""
MAX_CONFIG_DEPTH = 32


def _yaml_expansion(node, name: str) -> None:
    """ConfigError when the YAML node graph (aliases not yet expanded: yaml.compose shares the node an
    alias points to) would expand past MAX_CONFIG_VALUES values or MAX_CONFIG_DEPTH levels, or refers to
    itself. Counted per distinct node with memoisation, so a billion-laughs file costs its length, not
    its expansion: 26 levels of ``a{i}: {p: *a{i-1}, q: *a{i-1}}`` (731 bytes) once hung check."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(node, False)]
    while stack:
        n, done = stack.pop()
        key = id(n)
        children = (
            [c for pair in n.value for c in pair] if n.id == "mapping" else (n.value if n.id == "sequence" else [])
        )
        if done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
            if sizes[key] > MAX_CONFIG_VALUES or depths[key] > MAX_CONFIG_DEPTH:
                raise ConfigError(
                    f"--config={name!r} expands to more than {MAX_CONFIG_VALUES} values or {MAX_CONFIG_DEPTH} "
                    f"levels (YAML anchors and aliases): a file of flags needs neither; write the values out"
                )
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise ConfigError(f"--config={name!r} has a YAML alias that refers to itself: remove it")
        on_path.add(key)
        stack.append((n, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)


def _load_yaml(text: str, name: str):
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()  # the node graph: aliases are shared nodes, nothing expanded
        if node is None:
            return None
        _yaml_expansion(node, name)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_text(text: str, name: str) -> dict:
    """The mapping a .yaml / .yml / .toml file holds; ConfigError naming the file when it is not one
    (or when it is larger than MAX_CONFIG_BYTES, or its YAML aliases expand past MAX_CONFIG_VALUES)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"--config={name!r} holds {len(text)} characters, more than a file of flags ({MAX_CONFIG_BYTES})"
        )
    try:
        if name.endswith(".toml"):
            import tomllib

            data = tomllib.loads(text)
        elif name.endswith((".yaml", ".yml")):
            data = _load_yaml(text, name)
        else:
            raise ConfigError(f"--config={name!r}: give a .yaml, .yml or .toml file")
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(
            f"--config={name!r} is not valid {name.rsplit('.', 1)[-1].upper()}: {' '.join(str(e).split())[:200]}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config={name!r} must hold a mapping of flags (section: {{flag: value}}), got {type(data).__name__}"
        )
    return data


def _nest(d: dict, name: str) -> dict:
    """{'a.b': 1, 'a': {'c': 2}} -> {'a': {'b': 1, 'c': 2}} with dashes made underscores."""
    out: dict = {}
    for key, value in d.items():
        if not isinstance(key, str):
            raise ConfigError(f"--config={name!r}: key {key!r} is not a flag name")
        parts = key.replace("-", "_").split(".")
        cur = out
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
            if not isinstance(cur, dict):
                raise ConfigError(f"--config={name!r}: {key!r} is given both as a section and as a value")
        if isinstance(value, dict):
            cur.setdefault(parts[-1], {}).update(_nest(value, name))
        else:
            cur[parts[-1]] = value
    return out


def _coerce(value: Any, hint, flag: str, name: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = ConfigError(f"--config={name!r}: {flag}={value!r} is not a valid {getattr(hint, '__name__', hint)}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"--config={name!r}: {flag}={value!r}: choose one of {', '.join(map(str, args))}")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(_coerce(v, args[0], flag, name) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_coerce(v, a, flag, name) for v, a in zip(value, args))
    if hint is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if hint is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)  # YAML reads 1e-6 (no dot) as a string
        except (TypeError, ValueError):
            raise bad from None
    if hint is str:
        if not isinstance(value, str):
            raise bad
        return value
    return value


def apply_dict(base, d: dict, name: str, prefix: str = ""):
    """base (a config dataclass) with the file's values put in; ConfigError for an unknown key or a bad value."""
    hints = typing.get_type_hints(type(base))
    fields = {f.name for f in dataclasses.fields(base)}
    changes = {}
    for key, value in _nest(d, name).items():
        flag = f"{prefix}{key}".replace("_", "-")
        if key not in fields:
            raise ConfigError(
                f"--config={name!r}: unknown key {flag!r}{moved_hint(prefix + key)} (run with --help for the flags)"
            )
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"--config={name!r}: {flag} is a section: give a mapping of its flags")
            changes[key] = apply_dict(getattr(base, key), value, name, f"{prefix}{key}.")
        else:
            changes[key] = _coerce(value, hint, f"--{flag}", name)
    return dataclasses.replace(base, **changes)


def to_dict(cfg) -> dict:
    """The config as a nested mapping of plain values (tuples as lists), for YAML / TOML."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def dump_yaml(cfg, header: str = "") -> str:
    """The config as YAML that ``--config`` reads back into the same config."""
    import yaml

    body = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)
    return (header + body) if header else body


def _toml_value(v) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} to TOML")


def dump_toml(cfg, header: str = "") -> str:
    """The config as TOML that ``--config`` reads back into the same config (top-level flags, then
    one [section] per config section)."""
    # TOML has no null: an unset (None) flag is left out, and reading the file back leaves it unset.
    d = to_dict(cfg)
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if not isinstance(v, dict) and v is not None]

    def table(path: str, section: dict) -> None:  # a section within a section (--peer.<mode>): [peer.areal]
        lines.extend(["", f"[{path}]"])
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in section.items() if not isinstance(v, dict) and v is not None)
        for k, v in section.items():
            if isinstance(v, dict):
                table(f"{path}.{k}", v)

    for name, section in d.items():
        if isinstance(section, dict):
            table(name, section)
    return header + "\n".join(lines) + "\n"
