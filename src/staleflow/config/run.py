"""The whole run's config: the sections composed, checked together, resolved once, round-tripped
through JSON (a run folder's config.json, the start-up broadcast to every rank)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from staleflow.config.cluster import ClusterConfig
from staleflow.config.job import CheckpointConfig, DataConfig, EvalConfig, FaultConfig, LogConfig, RewardConfig
from staleflow.config.lora import LoraConfig
from staleflow.config.sections import (
    CoordinatorConfig,
    EnvConfig,
    ModelConfig,
    RolloutConfig,
    StalenessConfig,
    TrainConfig,
    _check,
)
from staleflow.modes import PeerSettings, apply_mode, check_mode
from staleflow.modes.base import registered, unknown_mode


def _check_finite(cfg, prefix: str = "") -> None:
    """Every float of a config (nested sections and tuples too) must be finite: inf or nan never
    means anything a run can use, and it fails far from the flag (a NaN loss, a hang)."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        flag = f"{prefix}{f.name.replace('_', '-')}"
        if dataclasses.is_dataclass(v):
            _check_finite(v, f"{flag}.")
        for x in v if isinstance(v, tuple) else (v,):
            if isinstance(x, float):
                _check(math.isfinite(x), flag, v, "must be a finite number")


@dataclass(frozen=True)
class RunConfig:
    """A whole training run (``python -m staleflow train``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    peer: PeerSettings = field(default_factory=PeerSettings)
    mode: str = "staleflow"
    """A registered mode: staleflow, a baseline named for its system (verl-sync (sync), verl-one-step-off
    (one-step-off), verl-fully-async, areal), an ablation (staleflow-no-exchange, staleflow-simple-strategies),
    or a fork's 'package.module:Class' (docs/baselines.md, docs/extending.md)."""
    steps: int = 20
    """Training steps (weight versions produced)."""
    seed: int = 0
    """Seed of the rollout sampling and of every seeded choice of the run (data order: --data.seed)."""
    resume: str = ""
    """Resume from this run folder's last checkpoint."""
    smoke: bool = False
    """Launcher smoke run: every rank registers, loads the model, reports, and exits."""

    def __post_init__(self):
        _check_finite(self)
        if ":" not in self.mode and registered(self.mode) is None:  # (a fork's import path: checked by resolve)
            raise unknown_mode(self.mode)
        _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        group_relative = ("grpo", "grpo-nostd", "dr-grpo", "rloo")
        _check(
            self.staleness.group_size >= 2 or self.train.advantage not in group_relative,
            "staleness.group-size",
            self.staleness.group_size,
            f"--train.advantage {self.train.advantage} compares responses within a "
            f"group: with 1 response per prompt every advantage is 0 and nothing is learnt; use >= 2",
        )
        _check(
            not self.env.name or self.env.max_total_tokens < self.rollout.max_model_len,
            "env.max-total-tokens",
            self.env.max_total_tokens,
            f"must be < --rollout.max-model-len ({self.rollout.max_model_len}): the prompt and every turn share it",
        )


def config_from_dict(cls, d: dict, unknown: list[str] | None = None, prefix: str = ""):
    """Rebuild a config dataclass (nested ones too) from its JSON form (metrics.writer.save_config). A key
    the dataclass lacks is appended, dotted, to `unknown` when given (the caller refuses it), else ignored."""
    import typing

    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if unknown is not None:
        unknown += [prefix + k for k in d if k not in names]
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v, hint = d[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint):
            v = config_from_dict(hint, v, unknown, f"{prefix}{f.name}.")
        elif isinstance(v, list) and typing.get_origin(hint) is tuple:
            v = tuple(v)
        kwargs[f.name] = v
    return cls(**kwargs)


def resolve(cfg: RunConfig) -> RunConfig:
    """The run's config with ``--mode`` applied to its coordinator and staleness sections (its --peer knobs
    checked: another mode's is an error): called once where the config is parsed; nothing downstream applies
    a mode again. An unknown mode is a ConfigError naming the flag."""
    check_mode(cfg.mode)
    coordinator, staleness = apply_mode(cfg.mode, cfg.coordinator, cfg.staleness, cfg.peer)
    return dataclasses.replace(cfg, coordinator=coordinator, staleness=staleness)
