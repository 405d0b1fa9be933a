"""scripts/compare_runs.py on run folders written by the real writers (MetricsWriter, save_config,
metrics.audit.version_counts, with the fields runtime/job.py gives them): planted staleness, token
versions, order, lags and trainer statistics come back as the right values and intervals."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from staleflow.config import RunConfig
from staleflow.metrics.audit import version_counts
from staleflow.metrics.stats import t_interval
from staleflow.metrics.writer import MetricsWriter, save_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compare_runs.py"


@pytest.fixture(scope="module")
def cr():
    spec = importlib.util.spec_from_file_location("compare_runs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compare_runs"] = mod  # its dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


def write_run(path: Path, seed: int, groups: list[dict], steps: int, train: dict | None = None, acc: float = 0.5):
    """A run folder as the runtime writes it. groups: dicts with buffer, group_id, V, rewards, and
    optionally versions (one list of per-token versions per member) and submitted_s."""
    w = MetricsWriter(str(path), tensorboard=False)
    save_config(str(path), dataclasses.replace(RunConfig(), seed=seed))
    for b in range(steps):
        for g in (g for g in groups if g["buffer"] == b):
            members = g.get("versions") or [[g["V"]] * 4 for _ in g["rewards"]]
            extra = {"submitted_s": g["submitted_s"]} if "submitted_s" in g else {}
            w.log_trained(
                b,
                g["group_id"],
                g["V"],
                list(range(len(g["rewards"]))),
                g["rewards"],
                prompt="p",
                answer="1",
                sample="s",
                prompt_id=g.get("prompt_id", g["group_id"]),
                content=["x"] * len(g["rewards"]),
                n_tokens=[len(m) for m in members],
                token_versions=[version_counts(m) for m in members],
                **extra,
            )
        row = {"reward_mean": 0.5, "interrupts": 3 * (b + 1), "migrations": b, "pulls": 2 * b, "train_s": 2.0}
        row["groups_aborted"] = b // 2
        row["train"] = dict((train or {}).get(b, {"behaviour_k3_mean": 0.01, "response_tokens": 100.0}))
        w.log_step(b, row)
        # the clock the writer stamps is real: overwrite it with a planted one (10 s a step)
    w.log_eval(steps, {"eval_accuracy": acc, "eval_n": 8, "eval_ci95_low": 0.0, "eval_ci95_high": 1.0})
    w.close()
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["time"] = 10.0 * (r["step"] + 1)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path


def stale_groups(n0: int, n1: int, steps: int = 10) -> list[dict]:
    """n0 groups at staleness 0 and n1 at staleness 1, spread over `steps` buffers (FIFO order)."""
    out = []
    for i, s in enumerate([0] * n0 + [1] * n1):
        b = 1 + i % (steps - 1)
        out.append({"buffer": b, "group_id": i, "V": b - s, "rewards": [1.0, 0.0, 1.0, 0.0]})
    return out


def row(rows, key):
    return next(r for r in rows if r["key"] == key)


def test_compare_runs_planted_staleness_share_and_bootstrap_interval(cr, tmp_path):
    a = cr.load_run(write_run(tmp_path / "a", 0, stale_groups(4, 16), 10))
    b = cr.load_run(write_run(tmp_path / "b", 0, stale_groups(10, 10), 10))
    rows = cr.compare([a], [b], n_boot=4000)
    r = row(rows, "groups_stale_1")
    assert r["a"] == pytest.approx(0.8) and r["b"] == pytest.approx(0.5) and r["diff"] == pytest.approx(-0.3)
    # independent binomial proportions over 20 groups each: half width ~ 1.96 sqrt(.8*.2/20 + .5*.5/20) = 0.28
    half = 1.96 * math.sqrt(0.8 * 0.2 / 20 + 0.25 / 20)
    lo, hi = r["ci95"]
    assert lo < -0.3 < hi and (hi - lo) / 2 == pytest.approx(half, rel=0.2) and "bootstrap over groups" in r["method"]
    assert row(rows, "staleness")["diff"] == pytest.approx(-0.3)
    # every group had rewards 1, 0, 1, 0: variance 0.25, none all-equal, reward 0.5
    assert row(rows, "reward_var")["a"] == pytest.approx(0.25) and row(rows, "all_equal")["a"] == 0.0
    assert row(rows, "final_accuracy")["ci95"] is None  # a run total has no interval from one run


def test_compare_runs_token_versions_give_mixed_shares(cr, tmp_path):
    """Half of A's groups have one member that took a keep-KV pull after 6 of its 8 tokens."""
    ga, gb = [], []
    for i in range(10):
        b = 1 + i % 5
        mixed = [b - 1] * 6 + [b] * 2
        plain = [b - 1] * 8
        ga.append(
            {"buffer": b, "group_id": i, "V": b - 1, "rewards": [1, 0], "versions": [mixed if i % 2 else plain, plain]}
        )
        gb.append({"buffer": b, "group_id": i, "V": b - 1, "rewards": [1, 0], "versions": [plain, plain]})
    a = cr.load_run(write_run(tmp_path / "a", 0, ga, 6))
    b = cr.load_run(write_run(tmp_path / "b", 0, gb, 6))
    rows = cr.compare([a], [b])
    # A: 160 tokens, 5 groups x 2 tokens sampled one version later (token staleness 0, newer than V_traj)
    assert row(rows, "tokens_newer")["a"] == pytest.approx(10 / 160) and row(rows, "tokens_newer")["b"] == 0.0
    assert row(rows, "tokens_stale_0")["a"] == pytest.approx(10 / 160)
    assert row(rows, "tokens_stale_1")["a"] == pytest.approx(150 / 160) and row(rows, "tokens_stale_1")["b"] == 1.0
    assert row(rows, "mixed_members")["a"] == pytest.approx(5 / 20)
    assert row(rows, "response_len")["a"] == pytest.approx(8.0)


def test_compare_runs_order_and_lag_from_drawing_to_training(cr, tmp_path):
    # A: FIFO, 2 groups a step; B: group 3 (drawn after 2) trained a step before group 2
    fifo = [{"buffer": i // 2, "group_id": i, "V": i // 2, "rewards": [1, 0]} for i in range(8)]
    swapped = [dict(g) for g in fifo]
    swapped[2]["buffer"], swapped[4]["buffer"] = 2, 1
    for g in fifo + swapped:  # drawn 5 s before the step that trained it started (steps end at 10 (b + 1) s)
        g["submitted_s"] = 10.0 * g["buffer"] - 5.0
    a = cr.load_run(write_run(tmp_path / "a", 0, fifo, 4))
    b = cr.load_run(write_run(tmp_path / "b", 0, swapped, 4))
    rows = cr.compare([a], [b])
    assert row(rows, "overtaken")["a"] == 0.0 and row(rows, "overtaken")["b"] == pytest.approx(1 / 8)
    assert row(rows, "order_spearman")["a"] == pytest.approx(cr.spearman(list(range(8)), [i // 2 for i in range(8)]))
    assert row(rows, "order_spearman")["b"] < row(rows, "order_spearman")["a"]
    # lag: 15 s each; in steps: buffer b's prompt was drawn when version b - 1 existed (buffer 0's two: 0)
    assert row(rows, "submit_to_train_s")["a"] == pytest.approx(15.0)
    assert row(rows, "queue_steps")["a"] == pytest.approx(6 / 8)
    # same prompt (same id = same seed's prompt stream): B trained prompt 2 a step later, prompt 4 a step earlier
    r = row(rows, "same_prompt_step_diff")
    assert r["diff"] == pytest.approx(0.0) and r["ci95"][0] <= 0 <= r["ci95"][1]
    assert (
        row(rows, "interrupts")["a"] == 12
        and row(rows, "migrations")["b"] == 3
        and row(rows, "groups_aborted")["a"] == 1
    )


def test_compare_runs_paired_over_seeds_uses_t_and_token_weighted_trainer_stats(cr, tmp_path):
    diffs = []
    runs_a, runs_b = [], []
    for seed, (ka, kb) in enumerate(((0.01, 0.02), (0.02, 0.025), (0.015, 0.04))):
        # step 0: k3 ka over 100 tokens; step 1: 3 * ka over 300 tokens -> token mean 2.5 * ka
        ta = {
            0: {"behaviour_k3_mean": ka, "response_tokens": 100.0},
            1: {"behaviour_k3_mean": 3 * ka, "response_tokens": 300.0},
        }
        tb = {
            0: {"behaviour_k3_mean": kb, "response_tokens": 100.0},
            1: {"behaviour_k3_mean": 3 * kb, "response_tokens": 300.0},
        }
        # B's seed folders are written in reverse order below: pairing must follow config.json's seed
        runs_a.append(write_run(tmp_path / f"a{seed}", seed, stale_groups(2, 2, 3), 2, ta, acc=0.5))
        runs_b.append(write_run(tmp_path / f"b{seed}", seed, stale_groups(2, 2, 3), 2, tb, acc=0.5 + seed / 10))
        diffs.append(2.5 * (kb - ka))
    a = [cr.load_run(p) for p in runs_a]
    b = [cr.load_run(p) for p in reversed(runs_b)]
    rows = cr.compare(a, b)
    r = row(rows, "behaviour_k3_mean")
    assert r["diff"] == pytest.approx(float(np.mean(diffs))) and r["ci95"] == pytest.approx(list(t_interval(diffs)))
    assert "3 paired seeds" in r["method"]
    acc = row(rows, "final_accuracy")
    assert acc["diff"] == pytest.approx(0.1) and acc["ci95"] == pytest.approx(list(t_interval([0.0, 0.1, 0.2])))
    # median over steps of the per-step k3: (ka + 3 ka) / 2 per run
    assert row(rows, "k3_median")["a"] == pytest.approx(np.mean([2 * k for k in (0.01, 0.02, 0.015)]))


@pytest.mark.scripts_smoke  # the smoke row of compare_runs.py in tests/test_scripts_smoke.py
def test_compare_runs_cli_prints_writes_json_and_rejects_bad_input(tmp_path):
    write_run(tmp_path / "a", 0, stale_groups(4, 16), 10)
    write_run(tmp_path / "b", 0, stale_groups(10, 10), 10)
    out = tmp_path / "cmp.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "a"), str(tmp_path / "b"), "--names", "sf,areal"]
        + ["--json", str(out), "--per-group", str(tmp_path / "groups.jsonl"), "--boot", "200"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "share of groups at staleness 1" in res.stdout and json.loads(res.stdout.splitlines()[-1])["a"] == "sf"
    saved = json.loads(out.read_text())
    assert row(saved["rows"], "groups_stale_1")["diff"] == pytest.approx(-0.3)
    assert len((tmp_path / "groups.jsonl").read_text().splitlines()) == 40
    # --bench: a bench_convergence --out folder, sides named by mode, every finished seed (bench.json) paired
    for side, n0 in (("staleflow-eta1", 4), ("areal-eta1", 10)):
        for seed in (0, 1):
            write_run(tmp_path / "bench" / f"{side}-seed{seed}", seed, stale_groups(n0, 20 - n0), 10)
            (tmp_path / "bench" / f"{side}-seed{seed}" / "bench.json").write_text("{}")
    write_run(tmp_path / "bench" / "areal-eta1-seed2", 2, stale_groups(0, 20), 10)  # unfinished: no bench.json
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "staleflow-eta1", "areal-eta1", "--bench", str(tmp_path / "bench")]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    r = row(json.loads(out.read_text())["rows"], "groups_stale_1")
    assert r["diff"] == pytest.approx(-0.3) and r["method"] == "t over 2 paired seeds"
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "a"), str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "no trained.jsonl" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_compare_runs_trainer_reports_the_mixed_version_share():
    """The trainer's mixed_token_frac / mixed_traj_frac (metrics.jsonl's train) on planted versions."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train_helpers import flat, random_batch, tiny_model

    from staleflow.config import TrainConfig
    from staleflow.train.trainer import Trainer

    batch = random_batch(seed=3, groups=2, min_response=4)
    samples = flat(batch)
    n_tok = sum(len(s.response_ids) for s in samples)
    for s in samples[::2]:  # every other response: its last 2 tokens sampled one version later (a keep-KV pull)
        s.versions = [2] * (len(s.response_ids) - 2) + [3, 3]
    for s in samples[1::2]:
        s.versions = [2] * len(s.response_ids)
    m = Trainer(tiny_model(seed=1), TrainConfig(lr=1e-3)).step(*batch)
    assert m["mixed_token_frac"] == pytest.approx(2 * len(samples[::2]) / n_tok)
    assert m["mixed_traj_frac"] == pytest.approx(0.5)


def test_compare_runs_pairs_the_seeds_both_sides_ran(cr):
    def run(seed):
        return {"seed": seed, "name": f"s{seed}"}

    pairs = cr.pair_runs([run(0), run(1), run(2)], [run(2), run(0)])
    assert [(x["seed"], y["seed"]) for x, y in pairs] == [(0, 0), (2, 2)]
    with pytest.raises(cr.RunError, match="no seed in common"):
        cr.pair_runs([run(0)], [run(1)])
    with pytest.raises(cr.RunError, match="as many on each side"):
        cr.pair_runs([run(None), run(None)], [run(None)])


def test_compare_runs_names_the_settings_the_sides_differ_in(tmp_path):
    """The settings two sides differ in are printed before the table (seeds and names left out); a key
    only an older config has is upgraded to where it moved, one only a newer config has counts as 'at
    today's default' when it is; a side whose own runs differ is warned about."""
    from staleflow.metrics.settings import run_settings, settings_diff

    a = write_run(tmp_path / "a", 0, stale_groups(4, 16), 10)
    b = write_run(tmp_path / "b", 0, stale_groups(10, 10), 10)
    cfg = json.loads((a / "config.json").read_text())  # A: saved before the peers' knobs moved (no --peer)
    cfg["mode"], cfg["staleness"]["eta"] = "areal", 1
    del cfg["peer"], cfg["lora"]
    cfg["coordinator"].update(max_concurrent_rollouts=0, strict=False)
    (a / "config.json").write_text(json.dumps(cfg))
    cfg = json.loads((b / "config.json").read_text())
    cfg["mode"], cfg["staleness"]["eta"], cfg["peer"]["areal"]["max_concurrent_rollouts"] = "areal", 3, 8
    (b / "config.json").write_text(json.dumps(cfg))
    runs = {
        n: [{"settings": run_settings(json.loads((p / "config.json").read_text()))}] for n, p in (("a", a), ("b", b))
    }
    diff = {d["key"]: d for d in settings_diff(runs["a"], runs["b"])}
    assert {k for k, d in diff.items() if not d["default"]} == {"staleness.eta", "peer.areal.max_concurrent_rollouts"}
    assert (diff["staleness.eta"]["a"], diff["staleness.eta"]["b"]) == ("1", "3")
    assert diff["lora.rank"] == {"key": "lora.rank", "a": "(absent)", "b": "0", "default": True}
    assert "seed" not in diff and not any(k.startswith("log.") for k in diff)
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(a),
            str(b),
            "--names",
            "A,B",
            "--boot",
            "50",
            "--json",
            str(tmp_path / "c.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "settings A -> B (config.json, first run of each side): 2 differ in effect" in res.stdout
    assert "  staleness.eta: 1 -> 3" in res.stdout and "  peer.areal.max_concurrent_rollouts: 0 -> 8" in res.stdout
    assert "only one side's config has, at today's default" in res.stdout
    c, d = (write_run(tmp_path / n, 1, stale_groups(4, 16), 10) for n in "cd")
    cfg = json.loads((c / "config.json").read_text())
    cfg["train"]["lr"] = 0.5
    (c / "config.json").write_text(json.dumps(cfg))
    res = subprocess.run(
        [sys.executable, str(SCRIPT), f"{b},{c}", f"{a},{d}", "--boot", "50"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "WARNING" in res.stdout and "differ among themselves in" in res.stdout and "train.lr" in res.stdout


def test_compare_runs_a_crafted_config_is_one_line(tmp_path):
    """A config.json with more settings than the reader takes is a one-line error, not a traceback."""
    a = write_run(tmp_path / "a", 0, stale_groups(4, 16), 10)
    b = write_run(tmp_path / "b", 0, stale_groups(4, 16), 10)
    (b / "config.json").write_text(json.dumps({"seed": 0, "x": {f"k{i}": i for i in range(5000)}}))
    bad = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "more than 4096 settings" in bad.stderr and len(bad.stderr.splitlines()) == 1
