"""Help that answers (issue 51): the top-level help lists every command in one line each, every
command's help names itself and lists --preset and --config among its options, ./launch.sh --help
prints once and starts nothing, and the flag names verl / TRL users type get one line naming ours."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.cli import ABOUT, SUBCOMMANDS, main
from staleflow.config import ConfigError, RunConfig
from staleflow.config.hints import HINTS, foreign_flag_hint, known_flags
from staleflow.config.parse import parse
from staleflow.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def _help(sub: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_text_top_level_lists_every_command_one_line_each():
    out = subprocess.run(
        [sys.executable, "-m", "staleflow", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0 and out.stderr == ""
    lines = out.stdout.splitlines()
    for sub in SUBCOMMANDS:
        (line,) = [ln for ln in lines if ln.split()[:1] == [sub]]
        assert ABOUT[sub] in line
    bad = subprocess.run([sys.executable, "-m", "staleflow", "trian"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown subcommand 'trian'" in bad.stderr


@pytest.mark.parametrize("sub", list(SUBCOMMANDS))
def test_help_text_names_its_command_and_lists_preset_and_config(sub, capsys):
    out = _help(sub, capsys)
    lines = out.splitlines()
    titles = [i for i, ln in enumerate(lines) if re.fullmatch(r"[\s╭─╮-]*([a-z-]+ )?options[\s╭─╮-]*", ln)]
    head = "\n".join(lines[: titles[0]]) if titles else out  # usage and description, before the option tables
    assert re.search(rf"^usage: (python -m )?staleflow {sub}\b", head, re.M), head[:300]
    assert f"staleflow {sub}" in head.split("\n", 1)[1], f"{sub}'s description does not name it"
    for other in SUBCOMMANDS:
        if other != sub:
            assert not re.search(rf"^(python -m )?staleflow {other}\b", head.split("\n", 2)[2], re.M), other
    assert "A whole training run" not in head or sub == "train"
    # the first table ("options", or plan's own list); tyro draws boxes on a terminal, plain text here
    options = "\n".join(lines[titles[0] : titles[1] if len(titles) > 1 else None]) if titles else out
    assert "--preset NAME" in options and "--config FILE" in options, f"{sub}: {options[:2000]}"


def test_help_text_launch_sh_prints_once_and_starts_nothing(tmp_path):
    env = dict(
        os.environ, VIRTUAL_ENV=sys.prefix, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    out = subprocess.run(
        ["bash", str(ROOT / "launch.sh"), "--preset", "tiny", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert text.count("usage:") == 1 and "usage: staleflow train" in text
    assert "./launch.sh --help" in text and "STALEFLOW_MAX_RESTARTS" in text
    # what a started run prints (a flag's help may mention a "memory plan", never its table's header)
    for started in ("torch/distributed/run.py", "memory plan: ", "ranks on 1 node", "[controller]"):
        assert started not in text, started


@pytest.mark.parametrize(
    "flag, ours",
    [
        ("--rollout.n", "--staleness.group-size"),
        ("--actor_rollout_ref.rollout.n", "--staleness.group-size"),
        ("--num_generations", "--staleness.group-size"),
        ("--num-generations", "--staleness.group-size"),
        ("--train_files", "--data.source"),
        ("--data.train_files", "--data.source"),
        ("--data.train-files", "--data.source"),
        ("--train_batch_size", "--staleness.batch-size"),
        ("--data.train_batch_size", "--staleness.batch-size"),
        ("--max_response_length", "--rollout.max-new-tokens"),
        ("--data.max_response_length", "--rollout.max-new-tokens"),
        ("--learning_rate", "--train.lr"),
        ("--actor_rollout_ref.actor.optim.lr", "--train.lr"),
    ],
)
def test_flag_hint_points_verl_and_trl_names_to_ours(flag, ours):
    for argv in ([flag, "8"], [f"{flag}=8"]):
        with pytest.raises(ConfigError) as e:
            parse(RunConfig, ["--preset", "tiny", *argv], PRESETS, "smollm2-cpu", "staleflow train")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{flag} is ") and f"StaleFlow's is {ours} (" in msg


def test_flag_hint_never_fires_for_our_own_flags():
    known = known_flags(RunConfig)
    ours = [f"--{k.replace('_', '-')}" for k in known] + ["--log.no-progress", "--no-smoke", "--rollout.temperature"]
    assert foreign_flag_hint(ours, known) is None
    assert all(target in known for _, target, _ in HINTS.values()), "a hint names a flag that does not exist"
    cfg = parse(RunConfig, ["--preset", "tiny", "--staleness.group-size", "3"], PRESETS, "smollm2-cpu", "t")
    assert cfg.staleness.group_size == 3


def test_flag_hint_is_one_line_and_exit_2_from_check():
    out = subprocess.run(
        [sys.executable, "-m", "staleflow", "check", "--preset", "tiny", "--rollout.n", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "staleflow: config error: --rollout.n is verl's name for it: StaleFlow's is --staleness.group-size "
        "(responses per prompt, N)"
    ]
