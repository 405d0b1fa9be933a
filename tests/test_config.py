"""Config tree: every validation rule gives a one-line error naming the flag; presets and the CLI parse."""

import dataclasses
import json
import subprocess
import sys

import pytest

from staleflow.cluster.roles import Roles
from staleflow.config import (
    CheckpointConfig,
    ConfigError,
    CoordinatorConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    StalenessConfig,
    TrainConfig,
)
from staleflow.config.job import FaultConfig
from staleflow.config.parse import parse, split_preset
from staleflow.presets import PRESETS

BAD = [
    (ModelConfig, {"path": ""}, "model.path"),
    (RolloutConfig, {"ranks": 0}, "rollout.ranks"),
    (RolloutConfig, {"max_running": 0}, "rollout.max-running"),
    (RolloutConfig, {"block_size": 0}, "rollout.block-size"),
    (RolloutConfig, {"max_kv_tokens": 8, "block_size": 16}, "rollout.max-kv-tokens"),
    (RolloutConfig, {"prefill_chunk_tokens": 0}, "rollout.prefill-chunk-tokens"),
    (RolloutConfig, {"temperature": 0.0}, "rollout.temperature"),
    (RolloutConfig, {"top_p": 1.5}, "rollout.top-p"),
    (RolloutConfig, {"top_k": -1}, "rollout.top-k"),
    (RolloutConfig, {"max_new_tokens": 0}, "rollout.max-new-tokens"),
    (RolloutConfig, {"max_model_len": 1}, "rollout.max-model-len"),
    (RolloutConfig, {"stats_interval_ms": 0}, "rollout.stats-interval-ms"),
    (RolloutConfig, {"length_dist": "normal:1:2"}, "rollout.length-dist"),
    (RolloutConfig, {"length_dist": "lognormal:0:1"}, "rollout.length-dist"),
    (StalenessConfig, {"eta": -1}, "staleness.eta"),
    (StalenessConfig, {"batch_size": 0}, "staleness.batch-size"),
    (StalenessConfig, {"batch_redundancy": -1}, "staleness.batch-redundancy"),
    (StalenessConfig, {"group_size": 0}, "staleness.group-size"),
    (StalenessConfig, {"group_redundancy": -2}, "staleness.group-redundancy"),
    (StalenessConfig, {"straggler_threshold": 0}, "staleness.straggler-threshold"),
    (TrainConfig, {"lr": 0.0}, "train.lr"),
    (TrainConfig, {"weight_decay": -1.0}, "train.weight-decay"),
    (TrainConfig, {"warmup_steps": -1}, "train.warmup-steps"),
    (TrainConfig, {"grad_clip": -1.0}, "train.grad-clip"),
    (TrainConfig, {"micro_batch_tokens": 0}, "train.micro-batch-tokens"),
    (TrainConfig, {"clip_low": -0.1}, "train.clip-low"),
    (TrainConfig, {"clip_high": -0.1}, "train.clip-high"),
    (TrainConfig, {"is_cap": 0.5}, "train.is-cap"),
    (TrainConfig, {"is_low": 1.5}, "train.is-low/is-high"),
    (TrainConfig, {"kl_coef": -1.0}, "train.kl-coef"),
    (CoordinatorConfig, {"mu": -1.0}, "coordinator.mu"),
    (CoordinatorConfig, {"max_concurrent": 0}, "coordinator.max-concurrent"),
    (CoordinatorConfig, {"pull_threshold": -1.0}, "coordinator.pull-threshold"),
    (CoordinatorConfig, {"phi_wait": -1}, "coordinator.phi-wait"),
    (CoordinatorConfig, {"psi": 1.0}, "coordinator.psi"),
    (CoordinatorConfig, {"migration_stop": -1}, "coordinator.migration-stop"),
    (CoordinatorConfig, {"tick_ms": 0.0}, "coordinator.tick-ms"),
    (RewardConfig, {"fn": ""}, "reward.fn"),
    (RewardConfig, {"workers": 0}, "reward.workers"),
    (DataConfig, {"source": ""}, "data.source"),
    (DataConfig, {"max_prompt_tokens": 0}, "data.max-prompt-tokens"),
    (CheckpointConfig, {"every": -1}, "checkpoint.every"),
    (CheckpointConfig, {"keep": 0}, "checkpoint.keep"),
    (FaultConfig, {"remote_lost_s": 0.0}, "fault.remote-lost-s"),
    (FaultConfig, {"remote_lost_s": 1e9}, "fault.remote-lost-s"),
    (RunConfig, {"steps": 0}, "--steps"),
]


@pytest.mark.parametrize("cls,kwargs,flag", BAD, ids=[f"{c.__name__}-{f}" for c, _, f in BAD])
def test_each_validation_rule_names_its_flag(cls, kwargs, flag):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    msg = str(err.value)
    assert flag in msg and "\n" not in msg


def test_presets_build_and_validate():
    for name, fn in PRESETS.items():
        cfg = fn()
        assert isinstance(cfg, RunConfig), name


def test_preset_and_flags_override():
    cfg = parse(
        RunConfig, ["--preset", "tiny", "--rollout.ranks", "3", "--staleness.eta", "2"], PRESETS, "smollm2-cpu", "t"
    )
    assert cfg.model.path == "tiny-llama" and cfg.rollout.ranks == 3 and cfg.staleness.eta == 2
    cfg = parse(RunConfig, ["--preset=tiny"], PRESETS, "smollm2-cpu", "t")
    assert cfg.model.path == "tiny-llama"
    assert parse(RunConfig, [], PRESETS, "smollm2-cpu", "t").model.path == "smollm2-135m"


def test_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match="--preset='nope' is unknown"):
        split_preset(["--preset", "nope"], PRESETS, "tiny")


def test_roles_layout_and_errors():
    roles = Roles(world_size=5, num_rollout=2)
    assert roles.trainer_ranks == [0, 1, 2] and roles.rollout_ranks == [3, 4]
    assert [roles.role(r) for r in range(5)] == ["trainer"] * 3 + ["rollout"] * 2
    assert roles.instance_id(4) == 1 and roles.is_leader(0)
    with pytest.raises(ConfigError, match="world size 2 is too small for --rollout.ranks=2"):
        Roles(world_size=2, num_rollout=2)


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "staleflow", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_bad_flag_value_exits_nonzero_with_one_line():
    res = _cli("train", "--staleness.eta", "-1")
    assert res.returncode == 2
    assert "--staleness.eta=-1 is invalid" in res.stderr


def test_cli_outside_torchrun_says_how_to_launch():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    res = _cli("train", "--preset", "tiny", env=env)
    assert res.returncode == 2 and "must run under torchrun" in res.stderr


def test_cli_unknown_subcommand():
    res = _cli("frobnicate")
    assert res.returncode == 2 and "unknown subcommand 'frobnicate'" in res.stderr


def test_group_relative_advantages_need_two_responses_per_prompt():
    from staleflow.config import StalenessConfig, TrainConfig

    with pytest.raises(ConfigError, match="group-size=1.*every advantage is 0"):
        RunConfig(staleness=StalenessConfig(group_size=1))
    with pytest.raises(ConfigError, match="rloo compares responses"):
        RunConfig(staleness=StalenessConfig(group_size=1), train=TrainConfig(advantage="rloo"))
    RunConfig(staleness=StalenessConfig(group_size=2))


def test_resume_merges_given_flags_into_the_saved_config_and_refuses_a_new_model(tmp_path):
    import dataclasses
    import json

    from staleflow.config import config_from_dict, resolve
    from staleflow.config.parse import given_flags
    from staleflow.launch.resume import merge_resume_config
    from staleflow.presets import PRESETS
    from staleflow.runfolder.run_dir import supersede_after

    saved = resolve(dataclasses.replace(PRESETS["tiny"](), steps=4))
    assert config_from_dict(RunConfig, json.loads(json.dumps(dataclasses.asdict(saved)))) == saved
    defaults = PRESETS["tiny"]()
    given = resolve(dataclasses.replace(defaults, steps=9, resume="x"))
    merged, notes = merge_resume_config(saved, given, defaults)
    assert merged.steps == 9 and merged.resume == "x" and notes == ["resume: --steps 9 (was 4)"]
    # a flag named on the command line counts even where it equals the preset's value (tiny: 4 steps)
    saved50 = dataclasses.replace(saved, steps=50)
    given4 = dataclasses.replace(defaults, resume="x")
    assert merge_resume_config(saved50, given4, defaults)[0].steps == 50  # not named: the saved run's
    merged, notes = merge_resume_config(saved50, given4, defaults, given_flags(["--resume", "x", "--steps", "4"]))
    assert merged.steps == 4 and notes == ["resume: --steps 4 (was 50)"]
    other = dataclasses.replace(defaults, model=dataclasses.replace(defaults.model, path="tiny-qwen2"))
    with pytest.raises(ConfigError, match="--model.path='tiny-qwen2' differs"):
        merge_resume_config(saved, other, defaults)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
    (tmp_path / "trained.jsonl").write_text("".join(json.dumps({"buffer": s}) + "\n" for s in range(4)))
    assert supersede_after(str(tmp_path), 2) == 4
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("superseded", False) for r in rows] == [False, False, True, True]
    assert supersede_after(str(tmp_path), 2) == 0  # idempotent


def test_given_flags_names_the_keys_the_command_line_sets():
    from staleflow.config.parse import given_flags

    flags = given_flags(
        [
            "--preset",
            "tiny",
            "--steps",
            "4",
            "--rollout.max-new-tokens=24",
            "--log.no-progress",
            "--train.loss_agg",
            "seq-mean",
            "-h",
            "4",
        ]
    )
    assert {"steps", "rollout.max_new_tokens", "log.progress", "train.loss_agg", "preset"} <= flags
    assert "4" not in flags and "h" not in flags


def _old_run(tmp_path, mode: str, **coordinator) -> str:
    """A run folder whose config.json was written before the peers' knobs moved to --peer (e06a2d0)."""
    from staleflow.config import resolve

    saved = dataclasses.asdict(resolve(dataclasses.replace(PRESETS["tiny"](), mode=mode)))
    del saved["peer"]  # that version had no --peer section
    saved["coordinator"].update(coordinator)
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps(saved))
    return str(tmp_path)


def test_resume_of_a_run_saved_before_a_key_moved_keeps_its_value_and_refuses_an_unknown_key(tmp_path):
    """A saved key that moved is put where it went (the resumed run keeps its setting, and says so); one
    this version does not know is refused by name, never dropped; a --config file is told the new flag."""
    from staleflow.config.file import apply_dict
    from staleflow.launch.resume import resumed_config

    defaults = PRESETS["tiny"]()
    given = dataclasses.replace(defaults, resume="x")
    old = {"max_concurrent_rollouts": 3, "staleness_threshold": None, "trigger_sync_steps": 1, "strict": True}
    cfg, notes = resumed_config(_old_run(tmp_path / "a", "areal", **old), given, defaults, frozenset())
    assert cfg.mode == "areal" and cfg.peer.areal.max_concurrent_rollouts == 3 and cfg.peer.areal.strict
    assert cfg.peer.verl_fully_async == type(cfg.peer.verl_fully_async)()  # its defaults: nothing else moved
    assert notes == [
        "resume: coordinator.max-concurrent-rollouts 3 moved to --peer.areal.max-concurrent-rollouts",
        "resume: coordinator.strict True moved to --peer.areal.strict",
    ]
    s = {"staleness_threshold": 0.5, "trigger_sync_steps": 2, "max_concurrent_rollouts": 0, "strict": False}
    cfg, _ = resumed_config(_old_run(tmp_path / "v", "verl-fully-async", **s), given, defaults, frozenset())
    assert (cfg.peer.verl_fully_async.staleness_threshold, cfg.peer.verl_fully_async.trigger_sync_steps) == (0.5, 2)
    # StaleFlow had no use for strict: False (its default) means nothing and goes; True is refused
    cfg, notes = resumed_config(_old_run(tmp_path / "s", "staleflow", strict=False), given, defaults, frozenset())
    assert cfg.mode == "staleflow" and notes == []
    with pytest.raises(ConfigError, match=r"sets coordinator\.strict, which this version of StaleFlow does not know"):
        resumed_config(_old_run(tmp_path / "t", "staleflow", strict=True), given, defaults, frozenset())
    with pytest.raises(ConfigError, match=r"sets coordinator\.gone_knob, .*start a new run"):
        resumed_config(_old_run(tmp_path / "g", "staleflow", gone_knob=7), given, defaults, frozenset())
    with pytest.raises(ConfigError, match=r"unknown key 'coordinator\.strict' \(moved to --peer\.<mode>\.strict\)"):
        apply_dict(defaults, {"coordinator": {"strict": True}}, "old.yaml")
