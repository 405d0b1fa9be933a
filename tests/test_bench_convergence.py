"""scripts/bench_convergence.py: its statistics on known runs, and its --smoke mode end to end
(real launches of the tiny preset), including resuming from the saved runs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_convergence.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_convergence", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(mode, eta, seed, accs, times, hist, wall):
    evals = [
        {"step": 5 * i, "accuracy": a, "ci95_low": a - 0.1, "ci95_high": a + 0.1, "n": 128, "t_policy": t}
        for i, (a, t) in enumerate(zip(accs, times))
    ]
    return {
        "mode": mode,
        "eta": eta,
        "seed": seed,
        "wall_s": wall,
        "evals": evals,
        "staleness_hist": hist,
        "staleness_max": max(hist),
        "load_start": 1.0,
        "load_end": 2.0,
    }


def test_ci95_bench_paired_difference_and_time_to_target(bench):
    sync = [
        _run("verl-sync", 0, s, [0.40, 0.50, a], [0, 100, 200], {0: 60}, 300) for s, a in enumerate((0.60, 0.62, 0.58))
    ]
    sf = [
        _run("staleflow", 1, s, [0.40, a0, a], [0, 80, 160], {0: 10, 1: 50}, 240)
        for s, (a0, a) in enumerate(((0.59, 0.63), (0.50, 0.66), (0.45, 0.55)))
    ]
    target, stats = bench.aggregate({("verl-sync", 0): sync, ("staleflow", 1): sf}, ("verl-sync", 0))
    assert target == pytest.approx(0.60 - 0.02)
    s = stats[("staleflow", 1)]
    diffs = [0.03, 0.04, -0.03]  # per seed, against the same seed's sync run
    assert s["diff_vs_sync"] == pytest.approx(sum(diffs) / 3) and s["paired_seeds"] == 3
    half = 4.302653 * math.sqrt(sum((d - sum(diffs) / 3) ** 2 for d in diffs) / 2) / math.sqrt(3)
    assert s["diff_ci95"] == pytest.approx([sum(diffs) / 3 - half, sum(diffs) / 3 + half])
    # reached 0.58 at: seed 0 t=80 (0.59), seed 1 t=160 (0.66), seed 2 never (0.55); sync: 200, 200, 200
    assert s["ttt_reached"] == 2 and s["ttt_s"] == pytest.approx(120) and s["ttt_vs_sync"] == pytest.approx(0.6)
    assert s["staleness_mean"] == pytest.approx(50 / 60) and s["staleness_max"] == 1
    assert s["wall_vs_sync"] == pytest.approx(0.8) and s["acc_final_std"] == pytest.approx(
        0.056862, abs=1e-6
    )  # sample std of 0.63, 0.66, 0.55
    assert stats[("verl-sync", 0)]["diff_ci95"] is None
    assert s["over_eta"] == 0 and s["groups"] == 180 and stats[("verl-sync", 0)]["over_eta"] == 0
    assert "(baseline)" in bench.table(stats, target) and "120 (2/3)" in bench.table(stats, target)


def test_bench_counts_groups_over_eta_from_the_histogram(bench):
    """A peer at nominal eta 1 that trained 10 of 60 groups per seed at staleness 2: 30 of 180 over eta
    (not the sum of metrics.jsonl's running over_eta totals, which the bench once reported)."""
    sync = [_run("verl-sync", 0, s, [0.4, 0.5, 0.6], [0, 100, 200], {0: 60}, 300) for s in range(3)]
    peer = [_run("areal", 1, s, [0.4, 0.5, 0.6], [0, 90, 180], {0: 5, 1: 45, 2: 10}, 250) for s in range(3)]
    for r in sync + peer:
        r["diag"] = dict.fromkeys(bench.DIAG, 0.0) | {"train_acc_last5": 0.5}
    target, stats = bench.aggregate({("verl-sync", 0): sync, ("areal", 1): peer}, ("verl-sync", 0))
    assert stats[("areal", 1)]["over_eta"] == 30 and stats[("areal", 1)]["groups"] == 180
    assert stats[("areal", 1)]["staleness_max"] == 2
    assert "30/180" in bench.table(stats, target) and "0/180" in bench.table(stats, target)


def test_bench_modes_need_the_sync_baseline(bench):
    assert bench.parse_modes("verl-sync,staleflow:2,areal") == [("verl-sync", 0), ("staleflow", 2), ("areal", 1)]
    with pytest.raises(SystemExit, match="verl-sync"):
        bench.parse_modes("staleflow:1")


@pytest.mark.slow
@pytest.mark.scripts_smoke  # the smoke row of bench_convergence.py in tests/test_scripts_smoke.py
def test_bench_convergence_smoke_runs_and_resumes(tmp_path):
    out = tmp_path / "conv"

    def smoke():
        res = subprocess.run(
            [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=ROOT,
        )
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        return res.stdout, json.loads(res.stdout.strip().splitlines()[-1])

    text, first = smoke()
    assert set(first) == {"target", "verl-sync", "staleflow eta 1"} and (out / "convergence.png").stat().st_size > 0
    sf = first["staleflow eta 1"]
    assert sf["seeds"] == 1 and sf["paired_seeds"] == 1 and sf["staleness_max"] <= 1 and sf["wall_s"] > 0
    saved = {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")}
    assert len(saved) == 2 and "hardware:" in text and "time-to-target" in text
    # a finished run keeps its metrics, not its ~2 GB of checkpoint and export (no --keep-models)
    assert not list(out.glob("*/checkpoints")) and not list(out.glob("*/hf")) and list(out.glob("*/bench.json"))
    _, again = smoke()  # every run is saved: nothing runs again, the same numbers come back
    assert again == first and {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")} == saved
