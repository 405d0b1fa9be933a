"""A run's config from the command line: a preset, then tyro's flags on top (every subcommand).

cfg = parse(RunConfig, argv, PRESETS, default="smollm2-cpu", prog="staleflow train")
defaults, rest = split_preset(argv, PRESETS, "smollm2-cpu")
given_flags(["--steps", "4"])   # frozenset({"steps"}): what a resume must apply
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

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


def parse(cls: type[T], argv: Sequence[str], presets: dict[str, Callable[[], T]], default: str, prog: str) -> T:
    """Parse a config dataclass from argv with tyro, starting from a preset."""
    import tyro

    base, rest = split_preset(argv, presets, default)
    description = f"{cls.__doc__ or ''}\n\nPresets (--preset NAME): {', '.join(presets)} (default {default})."
    return tyro.cli(cls, args=rest, default=base, prog=prog, description=description)


def given_flags(argv: Sequence[str]) -> frozenset[str]:
    """The dotted config keys the command line names: ``--rollout.max-new-tokens 24`` and
    ``--rollout.max_new_tokens=24`` give ``rollout.max_new_tokens``; ``--log.no-progress`` gives
    ``log.progress`` (and ``log.no_progress``). A resumed run applies these even where they equal
    the preset's value (launch/resume.merge_resume_config)."""
    out = set()
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name = tok[2:].split("=", 1)[0].replace("-", "_")
            head, dot, last = name.rpartition(".")
            out.add(name)
            if last.startswith("no_"):
                out.add(f"{head}{dot}{last[3:]}")
    return frozenset(out)
