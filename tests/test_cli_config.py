"""One CLI (issue 39): a help line on every flag, each subcommand's usage names itself, eval takes
train's flag names, --config files under the command line, recipes as presets, and `staleflow
check` refusing each bad input in one line with exit 2 before any rank starts."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from staleflow.config import ConfigError, RunConfig, resolve
from staleflow.config.parse import parse
from staleflow.launch import check
from staleflow.presets import MACHINES, PRESETS
from staleflow.presets_recipes import RECIPES

ROOT = Path(__file__).resolve().parents[1]


# ---- help text ---------------------------------------------------------------------------------


def _flags_without_help(cls, prefix=""):
    import tyro._docstrings as docs

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _flags_without_help(hints[f.name], f"{prefix}{f.name}.")
        elif not (docs.get_field_docstring(cls, f.name, ()) or "").strip():
            yield f"--{prefix}{f.name}".replace("_", "-")


def test_help_text_on_every_flag_of_every_subcommand():
    from staleflow.eval.command import EvalCommand
    from staleflow.sim.config import SimConfig

    for cls in (RunConfig, EvalCommand, SimConfig):
        assert list(_flags_without_help(cls)) == [], cls.__name__


@pytest.mark.parametrize("sub", ["train", "check", "plan", "sim", "eval"])
def test_help_text_usage_names_the_subcommand(sub, capsys):
    from staleflow.cli import main

    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert re.search(rf"^usage: (python -m )?staleflow {sub} ", out, re.M), out[:200]


def test_help_text_eval_uses_train_flag_names_and_refuses_the_old_ones(capsys):
    from staleflow.eval.command import RENAMED, main, parse_eval

    cfg = parse_eval(["--model.path", "tiny-llama", "--rollout.temperature", "0.5", "--rollout.max-new-tokens", "9"])
    assert (cfg.model.path, cfg.rollout.temperature, cfg.rollout.max_new_tokens) == ("tiny-llama", 0.5, 9)
    train_flags = {f"--{k}" for k in ("model.path", "rollout.temperature", "rollout.top-p", "rollout.max-new-tokens")}
    assert train_flags <= set(RENAMED.values())
    for old, new in RENAMED.items():
        assert main([old, "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{old} is now {new}" in err


# ---- config files ------------------------------------------------------------------------------


def test_config_file_yaml_and_toml_with_command_line_flags_winning(tmp_path):
    yml = tmp_path / "run.yaml"
    yml.write_text(
        "preset: tiny\ntrain:\n  lr: 1e-4\n  betas: [0.8, 0.9]\nrollout.max-new-tokens: 12\ndata:\n  mix: a.jsonl:1,b:2\n"
    )
    cfg = parse(RunConfig, ["--config", str(yml), "--rollout.max-new-tokens", "7"], PRESETS, "smollm2-cpu", "t")
    assert cfg.model.path == "tiny-llama" and cfg.train.lr == 1e-4 and cfg.train.betas == (0.8, 0.9)
    assert cfg.rollout.max_new_tokens == 7 and cfg.data.mix == "a.jsonl:1,b:2"
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 3\n[train]\nloss = "gspo"\n[staleness]\neta = 2\n')
    cfg = parse(RunConfig, [f"--config={toml}", "--preset", "tiny"], PRESETS, "smollm2-cpu", "t")
    assert (cfg.steps, cfg.train.loss, cfg.staleness.eta, cfg.model.path) == (3, "gspo", 2, "tiny-llama")


@pytest.mark.parametrize(
    "text, words",
    [
        ("train:\n  lrr: 1\n", "unknown key 'train.lrr'"),
        ("train:\n  lr: fast\n", "--train.lr='fast' is not a valid float"),
        ("rollout: 3\n", "rollout is a section"),
        ("mode: fastest\n", "--mode='fastest': choose one of"),
        ("train: [1, 2\n", "is not valid YAML"),
        ("- a\n- b\n", "must hold a mapping of flags"),
        ("train:\n  lr: 5.0\n", "--train.lr=5.0 is invalid"),
    ],
)
def test_config_file_bad_values_are_one_line(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse(RunConfig, ["--config", str(path)], PRESETS, "smollm2-cpu", "t")
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("preset", ["tiny", "smollm2-cpu", "gpu-7b+dapo"])
@pytest.mark.parametrize("mode", ["staleflow", "areal", "verl-sync"])
def test_config_file_written_by_a_run_repeats_its_resolved_config(tmp_path, preset, mode):
    from staleflow.metrics.writer import save_config

    argv = ["--preset", preset, "--mode", mode, "--train.lr", "3e-6", "--data.system-prompt", "Be: brief {x}"]
    cfg = resolve(parse(RunConfig, argv, PRESETS, "smollm2-cpu", "t"))
    save_config(str(tmp_path), cfg)
    for name in ("config.yaml", "config.toml"):  # a run repeats from either, whichever format its flags were in
        again = resolve(parse(RunConfig, ["--config", str(tmp_path / name)], PRESETS, "smollm2-cpu", "t"))
        assert again == cfg, name


def test_config_file_for_eval(tmp_path):
    from staleflow.eval.command import parse_eval

    path = tmp_path / "eval.yaml"
    path.write_text("model:\n  path: tiny-llama\nrollout:\n  temperature: 0.3\nsamples: 4\n")
    cfg = parse_eval(["--config", str(path), "--samples", "2"])
    assert (cfg.model.path, cfg.rollout.temperature, cfg.samples) == ("tiny-llama", 0.3, 2)


# ---- recipes -----------------------------------------------------------------------------------


def test_recipe_presets_set_their_papers_flags_over_any_machine():
    dapo = PRESETS["dapo"]()
    t = dapo.train
    assert (t.clip_low, t.clip_high, t.loss_agg, t.dynamic_sampling) == (0.2, 0.28, "token-mean", True)
    assert t.dynamic_sampling_refill > 0 and t.overlong_max_tokens == dapo.rollout.max_new_tokens
    assert 0 < t.overlong_cache_tokens < t.overlong_max_tokens
    assert PRESETS["gspo"]().train.loss == "gspo" and PRESETS["dr-grpo"]().train.advantage == "dr-grpo"
    assert PRESETS["grpo"]().train.kl_coef == 0.04
    for name, recipe in RECIPES.items():
        for machine, build in MACHINES.items():
            base, composed = build(), PRESETS[f"{machine}+{name}"]()
            # only the train section changes, and only the flags the recipe names
            assert dataclasses.replace(composed, train=base.train) == base
            changed = {
                f"--train.{f.name.replace('_', '-')}"
                for f in dataclasses.fields(base.train)
                if getattr(base.train, f.name) != getattr(composed.train, f.name)
            }
            assert changed <= set(recipe.flags(base)), (name, machine)


def test_recipe_docs_list_every_flag_and_source():
    doc = (ROOT / "docs" / "recipes.md").read_text()
    for name, recipe in RECIPES.items():
        assert f"`--preset {name}`" in doc and recipe.source.split(",")[0] in doc
        section = doc.split(f"`--preset {name}`", 1)[1].split("\n## ", 1)[0]
        for flag in recipe.flags(MACHINES["smollm2-cpu"]()):
            assert f"`{flag}" in section, (name, flag)


def test_recipe_train_loss_dapo_is_not_a_second_name_for_grpo(capsys):
    from staleflow.config import TrainConfig
    from staleflow.train.losses import LOSSES

    assert "dapo" not in LOSSES
    with pytest.raises(ConfigError, match="--train.loss='dapo' is invalid.*use --preset dapo"):
        TrainConfig(loss="dapo")
    with pytest.raises(SystemExit) as e:
        parse(RunConfig, ["--train.loss", "dapo"], PRESETS, "smollm2-cpu", "t")
    assert e.value.code == 2 and "--preset dapo" in " ".join(capsys.readouterr().err.split())


def test_recipe_gpu_7b_keeps_evaluation_dynamic_sampling_and_math_reward_and_default_is_unchanged():
    gpu = PRESETS["gpu-7b"]()
    assert gpu.eval.n > 0 and gpu.train.dynamic_sampling and gpu.reward.fn == "math"
    assert PRESETS["smollm2-cpu"]().train.dynamic_sampling_refill == 0  # the default job: filter only


def test_recipe_dapo_refill_replaces_all_equal_groups_under_the_protocol():
    """An all-equal group is aborted (its reservation released) and a fresh group takes the slot;
    past the per-step budget an all-equal group occupies as before; the bound holds throughout."""
    from controller_fakes import Prompts, ScriptedBackend
    from test_controller import COST, deliver, routed

    from staleflow.config import CoordinatorConfig, StalenessConfig
    from staleflow.controller import Finished, Rewarded
    from staleflow.controller.build import build_loop

    stale = StalenessConfig(eta=1, batch_size=1, group_size=2)
    be = ScriptedBackend()
    ccfg = CoordinatorConfig(routing="least-loaded", mlq=False, migration=False)
    loop = build_loop("staleflow", stale, ccfg, COST, range(1), be, Prompts(), 1, refill_groups=1)

    def finish_group(rewards):
        loop.refill()
        loop.tick(be.now() + 1)
        gid = next(
            g.group_id
            for g in loop.ledger.groups.values()
            if loop.manager.group_info(g.group_id)["buffer_version"] == 0
            and all(loop.ledger.trajs[t].traj_version is not None for t in g.members)
        )
        members = loop.ledger.groups[gid].members
        deliver(loop, be, *[Finished(t, 0, f"rec-{t}", 4) for t in members])
        deliver(loop, be, *[Rewarded(t, r) for t, r in zip(members, rewards)])
        return gid, members

    first, members = finish_group([1.0, 1.0])  # all equal: replaced
    assert loop.counts["groups_refilled"] == 1
    loop.tick(be.now() + 2)
    assert all(loop.ledger.ended.get(t, "").startswith("aborted") for t in members)
    assert {f"rec-{t}" for t in members} <= set(be.freed)
    assert len(routed(be)) > len(members)  # a fresh group was routed into the released slot
    second, _ = finish_group([0.0, 0.0])  # budget spent: it occupies (the trainer's filter drops it)
    loop.maybe_train()
    assert [v for v, _ in be.trained] == [0] and [g.group_id for g in be.trained[0][1]] == [second]
    assert loop.counts["groups_refilled"] == 1 and loop.audit.violations == []


# ---- check before launch -----------------------------------------------------------------------


def _refusal(argv, capsys, tmp_path) -> str:
    code = check.main(["--preset", "tiny", "--log.run-dir", str(tmp_path / "runs"), *argv])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_check_before_launch_refuses_bad_data(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    data = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": f"q{i}?", "solution": str(i)} for i in range(4)]), data)
    line = _refusal(["--data.source", str(data)], capsys, tmp_path)
    assert "none of its 4 rows is usable" in line and "missing field 'prompt'" in line
    assert "4 rows read, 0 usable, 4 bad: missing_field 4 (first row 1)" in line  # the whole file was read
    assert _refusal(["--data.source", str(tmp_path / "no.parquet")], capsys, tmp_path).endswith(
        "give an existing .jsonl, .parquet or .json file"
    )
    line = _refusal(["--data.mix", f"arithmetic:1,{data}:1"], capsys, tmp_path)
    assert f"--data.source={str(data)!r}: none of its 4 rows is usable" in line
    assert check.main(["--preset", "tiny", "--log.run-dir", str(tmp_path / "runs"), "--data.source", str(data),
                       "--data.prompt-field", "question"]) == 0  # fmt: skip


def test_check_before_launch_refuses_names_extras_and_lengths(tmp_path, capsys, monkeypatch):
    line = _refusal(["--coordinator.cost-model", "h100-fast"], capsys, tmp_path)
    assert line.startswith("staleflow: config error: --coordinator.cost-model='h100-fast'")
    line = _refusal(["--rollout.max-new-tokens", "300"], capsys, tmp_path)
    assert "--rollout.max-new-tokens=300 leaves no room for a prompt" in line
    line = _refusal(["--rollout.max-new-tokens", "250"], capsys, tmp_path)
    assert "+ --rollout.max-new-tokens=250 > --rollout.max-model-len=256" in line
    from staleflow.model import resolve_model_path

    limit = json.loads((Path(resolve_model_path("tiny-llama")) / "config.json").read_text())["max_position_embeddings"]
    line = _refusal(
        ["--rollout.max-model-len", str(limit + 1), "--rollout.max-kv-tokens", str(4 * limit)], capsys, tmp_path
    )
    assert f"> the model's max_position_embeddings={limit}" in line
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "vllm") else real(name, *a)
    )
    assert "--log.wandb needs the package wandb" in _refusal(["--log.wandb"], capsys, tmp_path)
    assert "--rollout.engine vllm needs the package vllm" in _refusal(["--rollout.engine", "vllm"], capsys, tmp_path)


def test_check_before_launch_trainer_ranks_against_gpus():
    from staleflow.launch.preflight import check_gpus

    cfg = PRESETS["tiny"]()
    check_gpus(cfg, 3, 0)  # CPU: processes, not GPUs
    check_gpus(cfg, 3, 1)  # 1 trainer on 1 GPU
    with pytest.raises(ConfigError, match="make 2 trainer ranks but this machine has 1 GPU"):
        check_gpus(cfg, 4, 1)


@pytest.mark.slow
def test_check_before_launch_stops_launch_sh_before_any_rank(tmp_path):
    """launch.sh with a data source missing its fields: one line, exit 2, and no rank ever ran
    (rank 0 would have made the run folder; torchrun would have printed its own lines)."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q?", "answer": "1"}) + "\n")
    runs = tmp_path / "runs"
    venv = ROOT / ".venv" / "bin"
    env = dict(os.environ, VIRTUAL_ENV=str(venv.parent), PATH=f"{venv}{os.pathsep}{os.environ['PATH']}", NPROC="3")
    res = subprocess.run(
        ["bash", str(ROOT / "launch.sh"), "--preset", "tiny", "--data.source", str(data), "--log.run-dir", str(runs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [x for x in (res.stdout + res.stderr).splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "missing field 'prompt'" in lines[0], lines
    assert list(runs.iterdir()) == [] if runs.exists() else True
    assert sys.executable  # the test ran in the project's interpreter
