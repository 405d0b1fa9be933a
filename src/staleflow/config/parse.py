"""A run's config from the command line: a preset, then a --config file, then tyro's flags on top
(every subcommand).

cfg = parse(RunConfig, argv, PRESETS, default="smollm2-cpu", prog="staleflow train")
cfg = parse(RunConfig, ["--config", "runs/X/config.yaml", "--steps", "4"], ...)   # the flag wins
defaults, rest = split_preset(argv, PRESETS, "smollm2-cpu")
given_flags(["--steps", "4"])   # frozenset({"steps"}): what a resume must apply
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Annotated, TypeVar

from staleflow.config.file import apply_dict, parse_text
from staleflow.config.sections import ConfigError

T = TypeVar("T")


def split_preset(argv: Sequence[str], presets: dict[str, Callable[[], T]], default: str) -> tuple[T, list[str]]:
    """Remove ``--preset NAME`` (or ``--preset=NAME``) from argv and build that preset's config."""
    argv = list(argv)
    name = default
    for i, arg in enumerate(argv):
        if arg == "--preset":
            if i + 1 >= len(argv):
                raise ConfigError(f"--preset needs a name; choose one of: {', '.join(presets)}")
            name = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--preset="):
            name = arg.split("=", 1)[1]
            del argv[i]
            break
    if name not in presets:
        raise ConfigError(f"--preset={name!r} is unknown; choose one of: {', '.join(presets)}")
    return presets[name](), argv


def split_config(argv: Sequence[str]) -> tuple[dict, str, list[str]]:
    """Remove ``--config FILE`` (or ``--config=FILE``) from argv: (the file's mapping, its name, the rest)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if i + 1 >= len(argv):
                    raise ConfigError("--config needs a file: a .yaml or .toml file of flags (docs/recipes.md)")
                name = argv[i + 1]
                del argv[i : i + 2]
            else:
                name = arg.split("=", 1)[1]
                del argv[i]
            from staleflow.config.file import MAX_CONFIG_BYTES
            from staleflow.inputs import InputError, read_capped

            try:  # a regular file only (a FIFO would hang the reader), at most 1 MiB
                text = read_capped(name, MAX_CONFIG_BYTES).decode("utf-8")
            except InputError as e:
                raise ConfigError(f"--config={name!r} cannot be read: {e}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"--config={name!r} is not UTF-8 (byte {e.start})") from None
            return parse_text(text, name), name, argv
    return {}, "", argv


def base_config(argv: Sequence[str], presets: dict[str, Callable[[], T]], default: str) -> tuple[T, list[str]]:
    """The config the command line's flags apply to: the preset (--preset, else the file's ``preset:``,
    else the default) with the --config file's values put in; and the remaining argv."""
    data, name, argv = split_config(argv)
    if "preset" in data and not any(a == "--preset" or a.startswith("--preset=") for a in argv):
        argv = ["--preset", str(data["preset"]), *argv]
    data = {k: v for k, v in data.items() if k != "preset"}
    base, rest = split_preset(argv, presets, default)
    return (apply_dict(base, data, name) if data else base), rest


def parse(
    cls: type[T], argv: Sequence[str], presets: dict[str, Callable[[], T]], default: str, prog: str, about: str = ""
) -> T:
    """Parse a config dataclass from argv with tyro, starting from a preset and a --config file. ``about``
    opens the --help text (what the command does; default: ``prog``: the class's docstring). A flag another system
    names differently (--rollout.n, --num_generations) is one ConfigError naming ours (config/hints.py)."""
    import tyro

    from staleflow.config.hints import foreign_flag_hint, known_flags

    base, rest = base_config(argv, presets, default)
    hint = foreign_flag_hint(rest, known_flags(cls))
    if hint:
        raise ConfigError(hint)
    description = (
        f"{about or prog + ': ' + (cls.__doc__ or '')}\n\nPresets (--preset NAME): {', '.join(presets)} (default {default}). "
        f"--config FILE reads flags from a .yaml / .toml file (command-line flags win)."
    )
    if any(a in ("-h", "--help") for a in rest):  # the options table lists --preset and --config too
        view, shown = help_view(cls, base, presets, default)
        return tyro.cli(view, args=rest, default=shown, prog=prog, description=description)
    return tyro.cli(cls, args=rest, default=base, prog=prog, description=description)


def help_view(cls: type[T], base: T, presets: dict, default: str) -> tuple[type, object]:
    """``cls`` with ``--preset`` and ``--config`` as fields, and ``base`` as one of it: what --help shows
    (both are taken off argv before tyro parses; only the help table needs them as fields)."""
    import tyro

    preset_help = f"Starting config, which the other flags override: {', '.join(presets)}."
    config_help = (
        "A .yaml / .toml file of these flags (a run folder's config.yaml repeats that run); flags given here win."
    )
    view = dataclasses.make_dataclass(
        cls.__name__,
        [
            (
                "preset",
                Annotated[str, tyro.conf.arg(help=preset_help, metavar="NAME")],
                dataclasses.field(default=default),
            ),
            ("config", Annotated[str, tyro.conf.arg(help=config_help, metavar="FILE")], dataclasses.field(default="")),
        ],
        bases=(cls,),
        frozen=cls.__dataclass_params__.frozen,
    )
    view.__doc__ = cls.__doc__
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls) if f.init}
    return view, view(**fields, preset=default, config="")


def given_flags(argv: Sequence[str]) -> frozenset[str]:
    """The dotted config keys the command line names: ``--rollout.max-new-tokens 24`` and
    ``--rollout.max_new_tokens=24`` give ``rollout.max_new_tokens``; ``--log.no-progress`` gives
    ``log.progress`` (and ``log.no_progress``). A resumed run applies these even where they equal
    the preset's value (launch/resume.merge_resume_config)."""
    out = set()
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name = tok[2:].split("=", 1)[0].replace("-", "_")
            if name == "config":
                continue
            head, dot, last = name.rpartition(".")
            out.add(name)
            if last.startswith("no_"):
                out.add(f"{head}{dot}{last[3:]}")
    return frozenset(out)
