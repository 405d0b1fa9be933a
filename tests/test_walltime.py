"""Where a run's wall time goes and why B reached a target later than A (metrics/walltime.py), the
typed timeline reader, and compare_runs.py's time-to-target split on planted run folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.metrics.records import RecordError, read_timeline
from staleflow.metrics.walltime import breakdown, explain_gap, step_gap_cv

ROOT = Path(__file__).resolve().parents[1]


def steps_of(n: int, train_s: float, tokens: int, wait_s: float, start_s: float = 0.0) -> list[dict]:
    """n step rows: each step the trainer waits wait_s, then trains `tokens` tokens in train_s (+0.5 s push)."""
    rows, t = [], start_s
    for k in range(n):
        t += wait_s + train_s + 0.5
        rows.append({"step": k, "time": t, "train_s": train_s, "push_s": 0.5, "trained_tokens": tokens})
    return rows


def test_walltime_gap_split_adds_up_and_names_each_cause():
    a = steps_of(10, 4.0, 100, 6.0)
    # more steps to reach it at the same pace: all of it is tokens (the method)
    more = explain_gap(a, 5, a, 8)
    assert more["gap_s"] == pytest.approx(31.5) and more["tokens_s"] == pytest.approx(3 * 4.5)
    assert more["rate_s"] == pytest.approx(0.0) and more["wait_s"] == pytest.approx(3 * 6.0)
    # the same steps, a trainer twice as slow per token: all of the busy difference is the rate (machine)
    slow = explain_gap(a, 5, steps_of(10, 8.5, 100, 6.0), 5)
    assert slow["tokens_s"] == pytest.approx(0.0) and slow["rate_s"] == pytest.approx(5 * 4.5)
    assert slow["wait_s"] == pytest.approx(0.0) and slow["ms_per_token"] == pytest.approx((45.0, 90.0))
    # waiting longer for batches: the wait term
    wait = explain_gap(a, 5, steps_of(10, 4.0, 100, 9.0), 5)
    assert wait["wait_s"] == pytest.approx(15.0) and wait["tokens_s"] == wait["rate_s"] == pytest.approx(0.0)
    # everything at once, a late start included (waiting): the terms add up to the gap exactly
    mixed = explain_gap(a, 4, steps_of(12, 6.0, 130, 2.0, start_s=40.0), 7)
    assert mixed["tokens_s"] + mixed["rate_s"] + mixed["wait_s"] == pytest.approx(mixed["gap_s"])
    assert mixed["steps"] == (4, 7)


def test_walltime_breakdown_trainer_exact_rollout_union_of_spans():
    steps = steps_of(4, 3.0, 50, 1.5)  # 5 s a step: wall 20 s, busy 14 s
    spans = [
        {"rank": 1, "kind": "generate", "t0": 0.0, "t1": 8.0},
        {"rank": 1, "kind": "generate", "t0": 6.0, "t1": 12.0},  # overlaps the first: counted once
        {"rank": 2, "kind": "generate", "t0": 10.0, "t1": 30.0},  # runs past the last step: cut at 20 s
        {"rank": 1, "kind": "pull", "t0": 12.0, "t1": 12.5},
        {"rank": 2, "kind": "pull", "t0": 5.0, "t1": 5.25},
        {"rank": 0, "kind": "train", "t0": 1.0, "t1": 4.0},
    ]
    b = breakdown(steps, [{"eval_s": 7.0}, {"eval_s": 2.0}], spans)
    assert b["wall_s"] == pytest.approx(20.0) and b["trainer_busy_s"] == pytest.approx(14.0)
    assert b["trainer_wait_s"] == pytest.approx(6.0) and b["trainer_busy_share"] == pytest.approx(0.7)
    assert b["trainer_ms_per_token"] == pytest.approx(1000 * 14.0 / 200) and b["eval_s"] == pytest.approx(9.0)
    assert b["rollout_busy_share"] == pytest.approx((12.0 + 10.0) / (2 * 20.0)) and b["pull_s"] == pytest.approx(0.75)
    assert "rollout_busy_share" not in breakdown(steps, [], None) and breakdown([], [], None) == {}


def test_walltime_step_rhythm_sees_bursts_and_leaves_out_start_up_and_evaluations():
    clock = steps_of(12, 3.0, 50, 1.5)  # a step every 5 s
    assert step_gap_cv(clock) == pytest.approx(0.0)
    late = [dict(r, time=r["time"] + (100.0 if r["step"] < 2 else 0.0)) for r in clock]
    late[0]["time"], late[1]["time"] = 1.0, 2.0  # start-up: steps 0-1 left out
    assert step_gap_cv(late) == pytest.approx(0.0)
    # bursts of 3 buffers: gaps 12, 1.5, 1.5 repeating -> sd / mean well above 0 (a clock reads 0)
    t, burst = 0.0, []
    for k in range(12):
        t += 12.0 if k % 3 == 0 else 1.5
        burst.append({"step": k, "time": t})
    cv = step_gap_cv(burst)
    assert cv is not None and cv > 0.9
    # an evaluation overlapping one gap leaves that gap out: a clock with one slowed gap reads as a clock again
    slowed = [dict(r, time=r["time"] + (20.0 if r["step"] >= 6 else 0.0)) for r in clock]
    assert step_gap_cv(slowed) > 0.5
    gap_at = (slowed[5]["time"], slowed[6]["time"])
    assert step_gap_cv(slowed, [{"time": gap_at[1] - 1.0, "eval_s": 5.0}]) == pytest.approx(0.0)
    assert step_gap_cv(slowed, [{"time": gap_at[0] - 1.0, "eval_s": 5.0}]) > 0.5  # ended before that gap
    assert step_gap_cv(slowed, [{"time": gap_at[1] - 1.0}]) > 0.5  # no eval_s: no interval, nothing left out
    both = breakdown(slowed, [{"time": gap_at[1] - 1.0, "eval_s": 5.0}])
    assert both["step_gap_cv"] == pytest.approx(0.0) and both["step_gap_cv_all"] == pytest.approx(step_gap_cv(slowed))
    assert step_gap_cv(clock[:4]) is None  # 1 gap from step 2 of 4 steps: no value
    assert breakdown(slowed, [])["step_gap_cv"] == pytest.approx(step_gap_cv(slowed))


def test_walltime_timeline_reader_is_typed_and_fails_in_one_line(tmp_path):
    p = tmp_path / "timeline.jsonl"
    p.write_text('{"rank": 0, "kind": "train", "t0": 1.0, "t1": 2.0}\n{"torn": \n')
    assert read_timeline(p) == [{"rank": 0, "kind": "train", "t0": 1.0, "t1": 2.0}]  # a torn line is skipped
    for bad, why in (
        ('{"rank": 0, "kind": "pull", "t0": 3.0, "t1": 2.0}', "before it starts"),
        ('{"rank": 0, "kind": "pull", "t0": "x", "t1": 2.0}', "'t0'"),
        ('{"rank": -1, "kind": "pull", "t0": 1.0, "t1": 2.0}', "'rank'"),
        ('{"rank": 0, "t0": 1.0, "t1": 2.0}', "'kind' is missing"),
    ):
        p.write_text(bad + "\n")
        with pytest.raises(RecordError, match=why) as e:
            read_timeline(p)
        assert "timeline.jsonl:1" in str(e.value) and "\n" not in str(e.value)


def write_run(path: Path, seed: int, steps: list[dict], evals: dict[int, float]) -> Path:
    """A run folder with the records compare_runs reads: one trained group per step, evaluations by version."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"seed": seed}))
    trained = [
        {"buffer": r["step"], "group_id": r["step"], "traj_version": r["step"], "rewards": [1.0, 0.0]} for r in steps
    ]
    (path / "trained.jsonl").write_text("".join(json.dumps(g) + "\n" for g in trained))
    made = {0: 0.0, **{r["step"] + 1: r["time"] for r in steps}}
    ev = [
        {"step": v, "time": made[v] + 1.0, "eval_n": 8, "eval_accuracy": acc, "eval_ci95_low": 0.0}
        | {"eval_ci95_high": 1.0, "eval_s": 1.0}
        for v, acc in evals.items()
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + ev))
    return path


@pytest.mark.scripts_smoke  # compare_runs.py's time-to-target split (its smoke row names the CLI test)
def test_walltime_compare_runs_splits_the_time_to_target_by_seed(tmp_path):
    """Seed 0: B reaches the target one evaluation later at A's pace (tokens); seed 1: at the same
    version with a trainer twice as slow per token (rate); seed 2: B never reaches it (left out)."""
    for seed in range(3):
        a = write_run(tmp_path / f"a{seed}", seed, steps_of(8, 4.0, 100, 6.0), {0: 0.3, 4: 0.6, 8: 0.6})
        b_steps = steps_of(8, 8.5 if seed == 1 else 4.0, 100, 6.0)
        b_evals = {0: 0.3, 4: 0.6 if seed == 1 else 0.4, 8: 0.6 if seed != 2 else 0.4}
        b = write_run(tmp_path / f"b{seed}", seed, b_steps, b_evals)
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare_runs.py"), ",".join(str(tmp_path / f"a{s}") for s in range(3))]
        + [",".join(str(tmp_path / f"b{s}") for s in range(3)), "--json", str(tmp_path / "c.json"), "--boot", "50"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "time to target 0.580 (2 paired seeds reached it on both sides)" in res.stdout
    saved = json.loads((tmp_path / "c.json").read_text())
    gaps = {g["seed"]: g for g in saved["time_to_target"]["pairs"]}
    assert set(gaps) == {0, 1} and gaps[0]["versions"] == [4, 8] and gaps[1]["versions"] == [4, 4]
    assert gaps[0]["tokens_s"] == pytest.approx(4 * 4.5) and gaps[0]["rate_s"] == pytest.approx(0.0)
    assert gaps[1]["rate_s"] == pytest.approx(4 * 4.5) and gaps[1]["tokens_s"] == pytest.approx(0.0)
    rows = {r["key"]: r for r in saved["rows"]}
    assert (
        rows["trainer_ms_per_token"]["a"] == pytest.approx(45.0) and "t over 3 paired seeds" in rows["wall_s"]["method"]
    )
    assert rows["trainer_busy_share"]["a"] == pytest.approx(4.5 / 10.5)
    # a given target: no pair reaches 0.9
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare_runs.py"), str(a), str(b), "--target", "0.9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "time to target 0.900 (0 paired seeds" in res.stdout
