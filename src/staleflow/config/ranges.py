"""The upper (and lower) bounds of the numeric flags: finite is not enough (``--train.entropy-coef
-1e30`` and ``--coordinator.migration-cooldown-s -1e30`` were accepted), so every number of a section
lies within its range here, every integer within +-MAX_COUNT. Each section's ``__post_init__``
(config/sections.py) calls ``in_range`` next to its own checks; a value outside is one line naming the
flag and its range (a ConfigError: ``staleflow check`` exits 2 before any process starts)."""

from __future__ import annotations

from staleflow.faults import ConfigError

MAX_COUNT = 1 << 40
"""An integer flag (a count, a size in tokens, a number of steps) beyond +-2**40 is a typo or a crafted config."""
RANGES = {
    "rollout.temperature": (0, 100),
    "rollout.stats-interval-ms": (0, 60_000),
    "train.weight-decay": (0, 10),
    "train.grad-clip": (0, 1e6),
    "train.clip-low": (0, 1),
    "train.clip-high": (0, 1e3),
    "train.is-cap": (1, 1e6),
    "train.is-high": (1, 1e6),
    "train.kl-coef": (0, 1e3),
    "train.entropy-coef": (-10, 10),
    "coordinator.mu": (0, 1e6),
    "coordinator.pull-threshold": (0, 1e6),
    "coordinator.psi": (0, 1e6),
    "coordinator.tick-ms": (0, 60_000),
    "coordinator.migration-cooldown-s": (0, 86_400),
    "coordinator.staleness-threshold": (0, MAX_COUNT),
    "env.step-timeout-s": (0, 86_400),
}
"""flag -> (low, high), both inclusive. A float flag not listed has only its section's own check and
finiteness (config/run.py); the sections keep their stricter lower bounds (> 0, >= 1)."""


def in_range(section, prefix: str) -> None:
    """ConfigError for the first numeric field of ``section`` outside its RANGES entry (integers: +-MAX_COUNT)."""
    for name, value in vars(section).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        flag = f"{prefix}.{name.replace('_', '-')}"
        low, high = RANGES.get(flag, (-MAX_COUNT, MAX_COUNT) if isinstance(value, int) else (None, None))
        if low is not None and not low <= value <= high:
            raise ConfigError(f"--{flag}={value!r} is invalid: must be in [{low:g}, {high:g}]")
