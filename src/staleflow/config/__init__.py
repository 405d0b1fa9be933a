"""One config tree for a StaleFlow run: a frozen dataclass per component (config/sections.py),
composed in RunConfig (config/run.py).

Exposed on the command line by tyro (``--rollout.ranks 2 --staleness.eta 2``); presets are
plain Python functions registered in staleflow.presets.PRESETS (``--preset tiny``, ``--preset
gpu-7b+dapo``); ``--config run.yaml`` (or .toml) holds flags under the command line's (config/file.py). Every ``__post_init__``
validates its fields and raises ConfigError with a one-line message naming the flag.
"""

from staleflow.config.job import CheckpointConfig, DataConfig, EvalConfig, FaultConfig, LogConfig, RewardConfig
from staleflow.config.lora import LoraConfig
from staleflow.config.run import RunConfig, config_from_dict, resolve
from staleflow.config.sections import (
    ConfigError,
    CoordinatorConfig,
    EnvConfig,
    ModelConfig,
    RolloutConfig,
    StalenessConfig,
    TrainConfig,
    _check,
    parse_length_dist,
)

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "CoordinatorConfig",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "FaultConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "StalenessConfig",
    "TrainConfig",
    "_check",
    "config_from_dict",
    "parse_length_dist",
    "resolve",
]
