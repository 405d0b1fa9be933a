"""scripts/bench_convergence.py: its statistics on known runs, and its --smoke mode end to end
(real launches of the tiny preset), including resuming from the saved runs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from statistics import stdev

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_convergence.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_convergence", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return bench_module()


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
    # censored pairs still count: staleflow first on seeds 0 and 1, sync first on seed 2 (staleflow never reached)
    assert s["ttt_first"] == [2, 1, 0] and s["ttt_sign_p"] == pytest.approx(1.0) and s["ttt_step"] == 7.5
    assert stats[("verl-sync", 0)]["ttt_step"] == 10 and stats[("verl-sync", 0)]["ttt_first"] is None
    assert s["staleness_mean"] == pytest.approx(50 / 60) and s["staleness_max"] == 1
    assert s["wall_vs_sync"] == pytest.approx(0.8) and s["acc_final_std"] == pytest.approx(
        0.056862, abs=1e-6
    )  # sample std of 0.63, 0.66, 0.55
    assert stats[("verl-sync", 0)]["diff_ci95"] is None
    assert s["over_eta"] == 0 and s["groups"] == 180 and stats[("verl-sync", 0)]["over_eta"] == 0
    assert "(baseline)" in bench.table(stats, target) and "120 (2/3)" in bench.table(stats, target)


def test_first_to_target_counts_censored_pairs_and_the_sign_test():
    from staleflow.metrics.convergence import first_to_target
    from staleflow.metrics.stats import sign_test

    assert first_to_target([(10.0, 20.0), (None, 5.0), (3.0, None), (None, None), (7.0, 7.0)]) == [2, 1, 2]
    assert sign_test(8, 0) == pytest.approx(2 / 256) and sign_test(0, 8) == sign_test(8, 0)
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    assert sign_test(6, 1) == pytest.approx(2 * (1 + 7) / 128)
    with pytest.raises(ValueError, match="counts"):
        sign_test(-1, 2)


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

    archive = tmp_path / "kept"

    def smoke(*more, where=out, code=0):
        res = subprocess.run(
            [sys.executable, str(SCRIPT), "--smoke", "--out", str(where), "--archive", str(archive), *more],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=ROOT,
        )
        assert res.returncode == code, res.stdout[-2000:] + res.stderr[-3000:]
        return (res.stdout, json.loads(res.stdout.strip().splitlines()[-1])) if code == 0 else (res.stdout, res.stderr)

    text, first = smoke()
    assert set(first) == {"target", "verl-sync", "staleflow eta 1", "equivalence"}
    assert (out / "convergence.png").stat().st_size > 0 and first["equivalence"] == {}  # 1 seed: no TOST
    sf = first["staleflow eta 1"]
    assert sf["seeds"] == 1 and sf["paired_seeds"] == 1 and sf["staleness_max"] <= 1 and sf["wall_s"] > 0
    # the mechanics come from metrics.jsonl: 2 steps, sync never interrupts, every token of sync is fresh
    assert first["verl-sync"]["mech"]["interrupts"] == [0] and first["verl-sync"]["mech"]["token_staleness"] == 0
    assert sf["mech"]["trainer_s"] > 0 and sf["mech"]["mixed_token_frac"] is not None and sf["load_max"] >= sf["load"]
    meta = json.loads(next(out.glob("staleflow*/bench.json")).read_text())
    assert set(meta) == set(bench_module().SAVED) and meta["load_samples"] >= 2  # only what the folder lacks
    # compare_runs reads the same two real run folders: sync's groups are all at staleness 0
    cmp = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare_runs.py"), str(out / "verl-sync-eta0-seed0")]
        + [str(out / "staleflow-eta1-seed0"), "--json", str(tmp_path / "cmp.json"), "--boot", "100"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cmp.returncode == 0, cmp.stderr[-2000:]
    rows = {r["key"]: r for r in json.loads((tmp_path / "cmp.json").read_text())["rows"]}
    assert rows["groups_stale_0"]["a"] == 1.0 and rows["tokens_stale_0"]["a"] == 1.0 and rows["staleness"]["a"] == 0
    assert sum(r["b"] for k, r in rows.items() if k.startswith("tokens_stale_")) == pytest.approx(1.0)
    assert rows["response_len"]["a"] > 0 and "submit_to_train_s" in rows
    evals = [json.loads(x) for x in (out / "staleflow-eta1-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["eval_correct"]) == r["eval_n"] == 4 for r in evals if "eval_n" in r)  # per-prompt answers
    saved = {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")}
    assert len(saved) == 2 and "hardware:" in text and "time-to-target" in text
    # a finished run keeps its metrics, not its ~2 GB of checkpoint and export (no --keep-models)
    assert not list(out.glob("*/checkpoints")) and not list(out.glob("*/hf")) and list(out.glob("*/bench.json"))
    _, again = smoke()  # every run is saved: nothing runs again, the same numbers come back
    assert again == first and {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.jsonl")} == saved
    # --archive kept each run's record (small: no checkpoint, no export; the timeline is kept); a new --out reads it back
    kept = {p.parent.name: sorted(f.name for f in p.parent.iterdir()) for p in archive.glob("*/bench.json")}
    assert kept == {n: sorted(bench_module().RECORD) for n in ("verl-sync-eta0-seed0", "staleflow-eta1-seed0")}
    assert (archive / "staleflow-eta1-seed0" / "metrics.jsonl").read_bytes() == (
        out / "staleflow-eta1-seed0" / "metrics.jsonl"
    ).read_bytes()
    _, moved = smoke("--no-run", where=tmp_path / "elsewhere")
    assert moved == first and not list((tmp_path / "elsewhere").glob("*/metrics.jsonl"))  # nothing ran
    # --no-run with nothing finished starts nothing and says so
    stdout, stderr = smoke("--no-run", "--archive", str(tmp_path / "empty"), where=tmp_path / "none", code=1)
    assert "not run (--no-run)" in stdout and "no verl-sync run finished" in stderr
    assert not list((tmp_path / "none").glob("*/metrics.jsonl"))


def _write_metrics(path: Path, k3: list[float], tokens: list[float], mixed: list[float], acc: float = 0.5):
    """A run folder's metrics.jsonl as the runtime writes it (MetricsWriter), one row per step."""
    from staleflow.metrics.writer import MetricsWriter

    w = MetricsWriter(str(path), tensorboard=False)
    for b, (k, n, m) in enumerate(zip(k3, tokens, mixed)):
        train = {"behaviour_k3_mean": k, "response_tokens": n, "mixed_token_frac": m, "token_staleness_mean": 1.0}
        row = {"reward_mean": 0.5, "interrupts": 5 * (b + 1), "migrations": 2 * (b + 1), "pulls": b, "train_s": 3.0}
        w.log_step(b, {**row, "train": train, "staleness_hist": {"1": 4}, "accuracy": 0.5})
    w.log_eval(0, {"eval_accuracy": 0.4, "eval_n": 8, "eval_ci95_low": 0.1, "eval_ci95_high": 0.8})
    w.log_eval(len(k3), {"eval_accuracy": acc, "eval_n": 8, "eval_ci95_low": 0.1, "eval_ci95_high": 0.8})
    w.close()
    return path


def test_bench_convergence_mechanics_come_from_metrics_jsonl(bench, tmp_path):
    run = bench.summarize_run(_write_metrics(tmp_path / "r", [0.001, 0.2, 0.003], [100, 100, 200], [0.0, 0.1, 0.4]), 99)
    # median KL over steps (the mean would be carried by the one big step), token-weighted mixed share
    assert run["kl_median"] == pytest.approx(0.003) and run["mixed_token_frac"] == pytest.approx((10 + 80) / 400)
    assert run["interrupts"] == 15 and run["migrations"] == 6 and run["trainer_s"] == pytest.approx(9.0)
    assert run["token_staleness"] == pytest.approx(1.0) and run["staleness_mean"] == 1.0
    m = bench.mechanics([run, run | {"interrupts": 26, "k3_steps": [0.5]}])
    assert m["interrupts"] == [15, 26] and m["kl_median"] == pytest.approx((0.003 + 0.2) / 2)  # pooled steps
    assert bench._span(m["interrupts"]) == "15-26"


def test_bench_convergence_resume_keeps_only_wall_and_load(bench, tmp_path):
    out = tmp_path / "run"
    _write_metrics(out, [0.01, 0.02], [10, 10], [0.0, 0.0], acc=0.75)
    # an older bench.json carried the whole summary: its numbers are not trusted, the folder's are
    (out / "bench.json").write_text(
        json.dumps({"name": "x", "mode": "staleflow", "eta": 1, "seed": 3, "wall_s": 500.0, "load_start": 1.0}).replace(
            "}", ', "load_end": 3.0, "evals": [{"step": 2, "accuracy": 0.99}], "interrupts": 777}'
        )
    )
    r = bench.load_saved(out)
    assert r["evals"][-1]["accuracy"] == 0.75 and r["interrupts"] == 10 and r["wall_s"] == 500.0
    assert r["load_mean"] == 2.0 and r["load_max"] == 3.0 and r["seed"] == 3


def test_bench_convergence_samples_the_load_while_a_run_runs(bench, tmp_path, monkeypatch):
    """run_one against a stand-in launch.sh that writes a finished run's metrics after a short wait."""
    fake = tmp_path / "root"
    fake.mkdir()
    (fake / "launch.sh").write_text(
        'while [ $# -gt 0 ]; do case "$1" in --log.run-dir) D=$2;; --log.name) N=$2;; esac; shift; done\n'
        'mkdir -p "$D/$N"; sleep 0.6\n'
        'echo \'{"step": 0, "time": 1.0, "reward_mean": 0.5, "train": {}, "train_s": 1.0}\' > "$D/$N/metrics.jsonl"\n'
        'echo \'{"step": 1, "time": 2.0, "eval_n": 4, "eval_accuracy": 0.5, "eval_ci95_low": 0, "eval_ci95_high": 1}\''
        ' >> "$D/$N/metrics.jsonl"\n'
    )
    monkeypatch.setattr(bench, "ROOT", fake)
    monkeypatch.setattr(bench, "LOAD_EVERY_S", 0.1)
    (tmp_path / "out").mkdir()
    args = type("A", (), {"out": str(tmp_path / "out"), "preset": [], "steps": 1, "seed": 0, "eval_n": 4})()
    args.eval_every, args.keep_models, args.archive, args.no_run = 1, False, None, False
    r = bench.run_one("m-eta1-seed0", "staleflow", 1, 0, args, [])
    assert r is not None and r["load_samples"] >= 4 and r["load_max"] >= r["load_mean"] > 0
    assert set(json.loads((tmp_path / "out" / "m-eta1-seed0" / "bench.json").read_text())) == set(bench.SAVED)
    # --archive given later: the finished run's record is copied on the next read (whole files, bench.json
    # last), and a record of another recipe is refused in one line instead of being read as this one's
    args.archive = str(tmp_path / "kept")
    assert bench.run_one("m-eta1-seed0", "staleflow", 1, 0, args, []) == r
    kept = tmp_path / "kept" / "m-eta1-seed0"
    assert sorted(p.name for p in kept.iterdir()) == ["bench.json", "metrics.jsonl"]  # what the stand-in wrote
    args.out, args.steps = str(tmp_path / "elsewhere"), 2
    with pytest.raises(SystemExit, match="a saved run of 1 steps evaluated on 4 prompts, not --steps 2"):
        bench.run_one("m-eta1-seed0", "staleflow", 1, 0, args, [])


def test_bench_convergence_equivalence_is_tost_on_paired_seeds(bench):
    from scipy.stats import t

    def runs(mode, eta, finals):
        return [_run(mode, eta, s, [0.4, a], [0, 100], {eta: 10}, 100) for s, a in enumerate(finals)]

    sync = runs("verl-sync", 0, [0.60, 0.50, 0.55, 0.58])
    sf = runs("staleflow", 1, [0.61, 0.49, 0.56, 0.57])  # differences +0.01, -0.01, +0.01, -0.01
    far = runs("areal", 1, [0.70, 0.62, 0.66, 0.72])  # staleflow - areal: -0.09, -0.13, -0.10, -0.15
    peer = runs("verl-fully-async-matched", 1, [0.61, 0.49, 0.56])  # 3 seeds: paired on those
    results = {("verl-sync", 0): sync, ("staleflow", 1): sf, ("areal", 1): far, ("verl-fully-async-matched", 1): peer}
    e = bench.equivalence(results, ("staleflow", 1), ("verl-sync", 0), 0.05)
    d = [0.01, -0.01, 0.01, -0.01]
    se = stdev(d) / 2
    assert e["mean"] == pytest.approx(0.0) and e["equivalent"] and e["seeds"] == 4
    assert e["p"] == pytest.approx(t.sf(0.05 / se, 3)) and e["ci"][1] == pytest.approx(t.ppf(0.95, 3) * se)
    lines, out = bench.equivalence_lines(results, 0.05)
    assert len(lines) == 3 and "EQUIVALENT within" in lines[0] and "not shown equivalent" in lines[1]
    assert out["staleflow eta 1 - areal eta 1"]["mean"] == pytest.approx(-0.1175)
    assert lines[2].startswith("staleflow eta 1 - verl-fully-async-matched eta 1: final accuracy +0.000")
    assert out["staleflow eta 1 - verl-fully-async-matched eta 1"]["seeds"] == 3
    # seeds needed at the observed sd: a tiny spread needs few, the TOST needs at least as many as detection
    assert 2 <= e["seeds_to_detect"] <= e["seeds_for_equivalence"] <= 4
    assert (
        bench.equivalence({("staleflow", 1): sf[:1], ("verl-sync", 0): sync}, ("staleflow", 1), ("verl-sync", 0), 0.05)
        is None
    )


def test_bench_convergence_seed_ranges(bench):
    assert bench.parse_seeds("0-7") == list(range(8)) and bench.parse_seeds("0-2,8,1") == [0, 1, 2, 8]
    with pytest.raises(SystemExit, match="range"):
        bench.parse_seeds("a-b")


def test_bench_convergence_splits_the_spread_into_evaluation_noise(bench):
    """Per-prompt answers (eval_correct) give the evaluation-noise part of a paired difference."""
    # one prompt of 10 answered differently: z = (1, 0 x 9), sample variance s^2 = 0.9 / 9, of the mean s^2 / 10
    assert bench.eval_noise_var({"correct": "1111100000"}, {"correct": "1111000000"}) == pytest.approx(0.01)
    assert bench.eval_noise_var({"correct": None}, {"correct": "10"}) is None

    def runs(mode, eta, answers):
        out = []
        for s, c in enumerate(answers):
            r = _run(mode, eta, s, [0.4, c.count("1") / len(c)], [0, 100], {eta: 10}, 100)
            r["evals"][-1]["correct"] = c
            out.append(r)
        return out

    sync = runs("verl-sync", 0, ["1100000000", "1110000000", "1000000000"])
    sf = runs("staleflow", 1, ["1110000000", "1100000000", "1000000000"])  # diffs +0.1, -0.1, 0
    e = bench.equivalence({("verl-sync", 0): sync, ("staleflow", 1): sf}, ("staleflow", 1), ("verl-sync", 0), 0.05)
    var_eval = (0.01 + 0.01 + 0) / 3
    assert e["sd"] == pytest.approx(0.1) and e["sd_eval"] == pytest.approx(math.sqrt(var_eval))
    assert e["sd_train"] == pytest.approx(math.sqrt(0.01 - var_eval))
    assert e["sd_at_4x_eval_n"] == pytest.approx(math.sqrt(0.01 - var_eval + var_eval / 4))
    assert e["seeds_to_detect_at_4x_eval_n"] <= e["seeds_to_detect"]


def test_bench_convergence_matched_peer_launches_verl_with_its_knobs(bench):
    """verl-fully-async-matched:eta is verl fully-async with s = 0 and T = eta + 1 (bounded at eta by a count);
    a plain mode is launched as itself; the config parser accepts the flags it adds."""
    assert bench.parse_modes("verl-sync,verl-fully-async-matched:2") == [
        ("verl-sync", 0),
        ("verl-fully-async-matched", 2),
    ]
    flags = bench.launch_mode("verl-fully-async-matched", 2)
    assert flags == [
        "--mode",
        "verl-fully-async",
        "--peer.verl-fully-async.staleness-threshold",
        "0",
        "--peer.verl-fully-async.trigger-sync-steps",
        "3",
    ]
    assert bench.launch_mode("areal", 1) == ["--mode", "areal"]
    from staleflow.config import RunConfig
    from staleflow.config.parse import parse
    from staleflow.modes import mode_settings
    from staleflow.presets import PRESETS

    cfg = parse(RunConfig, [*flags, "--staleness.eta", "2"], PRESETS, default="tiny", prog="t")
    knobs = mode_settings(cfg.mode, cfg.peer)
    assert (knobs.staleness_threshold, knobs.trigger_sync_steps) == (0.0, 3)
