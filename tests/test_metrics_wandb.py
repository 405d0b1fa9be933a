"""Weights & Biases logging (--log.wandb) in offline mode: the same metric names as TensorBoard."""

from __future__ import annotations

import json

import pytest

from staleflow.metrics.writer import MetricsWriter

wandb = pytest.importorskip("wandb")


def test_wandb_offline_logs_the_metric_names_of_metrics_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    w = MetricsWriter(str(run), tensorboard=False, wandb_project="staleflow-test", config={"steps": 2})
    logged, real_log = [], w._wb.log

    def log(data, step=None, **kw):  # the real W&B run (offline) records it; we keep a copy to check
        logged.append((dict(data), step))
        return real_log(data, step=step, **kw)

    w._wb.log = log
    w.log_step(0, {"reward_mean": 0.25, "train": {"loss": 1.5}, "staleness_hist": {"0": 4}})
    w.log_step(1, {"reward_mean": 0.5, "train": {"loss": 1.0}, "staleness_hist": {"1": 4}})
    w.log_eval(0, {"eval_accuracy": 0.1, "eval_n": 64})
    w.close()
    assert logged[1] == ({"reward_mean": 0.5, "train/loss": 1.0, "staleness_hist/1": 4.0}, 1)
    assert logged[2] == ({"eval/step": 0, "eval/accuracy": 0.1, "eval/n": 64.0}, None)
    files = list(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0  # wandb sync can upload it later
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["reward_mean"] == 0.5 and rows[2]["eval_accuracy"] == 0.1  # metrics.jsonl unchanged


def test_wandb_missing_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(RuntimeError, match=r"staleflow\[wandb\]"):
        MetricsWriter(str(tmp_path / "r"), tensorboard=False, wandb_project="p")
