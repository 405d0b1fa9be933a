"""Steps that say what happened (issue 51): every step line names what it trained (groups, responses,
tokens, mean length) and, when it could learn nothing, why; the console and metrics.jsonl number
steps the same way; --log.no-progress keeps the lines (it drops only the bar); and a step that trains
responses finished before the previous step does not report a mean length of 0."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from staleflow.controller.audit import Audit
from staleflow.controller.step_metrics import step_metrics
from staleflow.controller.types import StepRecord
from staleflow.metrics.progress import ProgressDisplay, nothing_learned, step_line
from staleflow.trajectory import RecordHandle, TrainGroup

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def _row(**over) -> dict:
    row = {
        "reward_mean": 0.25,
        "accuracy": 0.25,
        "tokens_per_s": 120.0,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "pulls": 2,
        "interrupts": 1,
        "train_s": 1.25,
        "trained_groups": 8,
        "trained_trajectories": 32,
        "trained_tokens": 541,
        "train": {"samples_trained": 32.0, "groups_dropped": 0.0, "advantage_abs_mean": 0.4},
    }
    row.update(over)
    return row


def test_step_line_says_what_the_step_trained():
    line = step_line(3, 20, _row())
    assert line.startswith("step 3 (4/20)  trained 8 groups, 32 responses, 541 tokens (mean len 16.9)  ")
    assert "learned nothing" not in line and nothing_learned(_row()) is None


def test_step_line_says_why_a_step_learned_nothing():
    equal = _row(reward_mean=0.0, train={"samples_trained": 32.0, "groups_dropped": 0.0, "advantage_abs_mean": 0.0})
    line = step_line(8, 20, equal)
    assert "trained 8 groups, 32 responses, 541 tokens" in line
    assert line.endswith(
        "-- learned nothing: the rewards within every group were equal (mean 0.000): every advantage is 0"
    )
    dropped = _row(train={"samples_trained": 0.0, "groups_dropped": 8.0, "advantage_abs_mean": 0.0})
    assert step_line(1, 3, dropped).endswith(
        "-- learned nothing: dynamic sampling dropped all 8 groups (the rewards within each group were all equal)"
    )
    some = _row(train={"samples_trained": 24.0, "groups_dropped": 2.0, "advantage_abs_mean": 0.3})
    assert step_line(1, 3, some).endswith("(dynamic sampling dropped 2 groups with equal rewards)")


def test_step_line_mean_length_is_the_trained_responses_not_the_finished_ones():
    """The step that trained 32 responses of 10-23 tokens read len 0 when none finished since the
    previous step: response_len_mean is now the trained responses' mean."""
    lens = [10 + (i % 14) for i in range(32)]
    groups = [
        TrainGroup(
            g, 0, list(range(4 * g, 4 * g + 4)), [RecordHandle(1, 0, 0, 0)] * 4, [0.0] * 4, lens[4 * g : 4 * g + 4], 9
        )
        for g in range(8)
    ]
    rec = StepRecord(version=7, t_start=0.0, groups=groups, staleness=[1] * 8)
    row = step_metrics(rec, [], Audit(), Counter(), 0)
    assert row["response_len_mean"] == pytest.approx(sum(lens) / 32) and row["finished_len_mean"] == 0.0
    assert row["trained_tokens"] == sum(lens) and row["trained_trajectories"] == 32


def test_step_line_printed_without_the_bar(capsys):
    shown = ProgressDisplay(5, bar=False, start=0)
    shown.update(0, _row())
    shown.update(1, _row())
    shown.close()
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(" (")[0] for ln in out] == ["step 0", "step 1"]


@pytest.mark.slow
def test_step_line_numbers_match_metrics_and_no_progress_keeps_them(tmp_path):
    """A real run (tiny+dapo, whose random model never answers right, so dynamic sampling drops every
    group) with --log.no-progress: one line per step, numbered as metrics.jsonl, each saying why it
    learned nothing."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m", "staleflow"]
    cmd += ["train", "--preset", "tiny+dapo", "--steps", "2", "--log.run-dir", str(tmp_path), "--log.name", "run"]
    cmd += ["--log.no-progress", "--log.no-plot", "--log.no-tensorboard", "--checkpoint.no-export-hf"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, start_new_session=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if re.match(r"^step \d+ \(\d+/2\)  trained ", ln)]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in rows if "eval_n" not in r]
    assert [int(ln.split()[1]) for ln in lines] == steps == [0, 1], out.stdout[-3000:]
    for ln, row in zip(lines, rows):
        assert f"trained {row['trained_groups']} groups, {row['trained_trajectories']} responses" in ln
        assert "-- learned nothing: dynamic sampling dropped all" in ln, ln
        assert row["response_len_mean"] > 0
