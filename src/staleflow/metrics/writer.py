"""Run-folder metrics: one JSON line per training step, a timeline of per-rank activity,
TensorBoard scalars, and the run's resolved config.

    run_dir/metrics.jsonl    {"step": v, "reward_mean": ..., "tokens_per_s": ..., "staleness": {...}, ...}
    run_dir/timeline.jsonl   {"rank": r, "kind": "generate"|"train"|"pull"|..., "t0": s, "t1": s}
    run_dir/trained.jsonl    {"buffer": v, "group_id": g, "traj_version": V, "traj_ids": [...], "rewards": [...],
                              "prompt": ..., "answer": ..., "sample": first member's response, "prompt_id": p,
                              "content": [metrics.audit.content_digest of each member, as the trainer read it],
                              "n_tokens": [response length of each member],
                              "token_versions": [[[version, tokens], ...] per member: audit.version_counts],
                              "submitted_s": when the loop drew the prompt (run seconds; absent if requeued)}
    run_dir/tb/              TensorBoard events (scalars of metrics.jsonl)
    run_dir/wandb/           Weights & Biases files (--log.wandb; the same metric names as TensorBoard)
    run_dir/config.json      the RunConfig of the run (config.yaml, config.toml: the same, as --config flags)
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from staleflow import durable


def _scalars(prefix: str, d: dict[str, Any]):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, bool):
            yield key, float(v)
        elif isinstance(v, (int, float)):
            yield key, float(v)
        elif isinstance(v, dict):
            yield from _scalars(f"{key}/", v)


class MetricsWriter:
    """Append-only metrics of one run; safe to reopen on resume (appends)."""

    def __init__(self, run_dir: str, tensorboard: bool = True, wandb_project: str = "", config: dict | None = None):
        """wandb_project: also log to Weights & Biases (optional extra staleflow[wandb]); the W&B
        run id is derived from the run folder, so a resumed run continues the same W&B run."""
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        self._timeline = open(os.path.join(run_dir, "timeline.jsonl"), "a", buffering=1)
        self._trained = open(os.path.join(run_dir, "trained.jsonl"), "a", buffering=1)
        self.t_start = time.time()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except ImportError:  # tensorboard is a declared dependency; tolerate its absence in forks
                self._tb = None
        self._wb = _wandb_run(run_dir, wandb_project, config) if wandb_project else None

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": round(time.time() - self.t_start, 4), **metrics}
        self._metrics.write(json.dumps(row, sort_keys=True) + "\n")
        if self._wb is not None:
            self._wb.log({k: v for k, v in _scalars("", metrics)}, step=step)
        if self._tb is not None:
            for key, value in _scalars("", metrics):
                self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def log_eval(self, step: int, row: dict[str, Any]) -> None:
        """A held-out evaluation: a metrics.jsonl row with eval_accuracy / eval_n (no training
        fields), TensorBoard scalars under eval/."""
        out = {"step": step, "time": round(time.time() - self.t_start, 4), **row}
        self._metrics.write(json.dumps(out, sort_keys=True) + "\n")
        if self._wb is not None:  # own x-axis (eval/step): an evaluation may arrive after later steps
            self._wb.log(
                {"eval/step": step, **dict(_scalars("eval/", {k.removeprefix("eval_"): v for k, v in row.items()}))}
            )
        if self._tb is not None:
            for key, value in _scalars("eval/", {k.removeprefix("eval_"): v for k, v in row.items()}):
                self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def log_span(self, rank: int, kind: str, t0: float, t1: float, **extra) -> None:
        """A span of activity of one rank (wall-clock seconds since the epoch)."""
        row = {
            "rank": rank,
            "kind": kind,
            "t0": round(t0 - self.t_start, 4),
            "t1": round(t1 - self.t_start, 4),
            **extra,
        }
        self._timeline.write(json.dumps(row) + "\n")

    def log_trained(
        self, buffer_version: int, group_id: int, traj_version: int, traj_ids: list[int], rewards: list[float], **extra
    ) -> None:
        """One consumed group: the audit trail of the staleness bound (and of no double training)."""
        row = {
            "buffer": buffer_version,
            "group_id": group_id,
            "traj_version": traj_version,
            "traj_ids": traj_ids,
            "rewards": rewards,
            **extra,
        }
        self._trained.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._metrics.close()
        self._timeline.close()
        self._trained.close()
        if self._tb is not None:
            self._tb.close()
        if self._wb is not None:
            self._wb.finish()


def _wandb_run(run_dir: str, project: str, config: dict | None):
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "--log.wandb needs the optional extra: pip install 'staleflow[wandb]' (or pip install "
            "wandb); set WANDB_MODE=offline to log without an account"
        ) from None
    import hashlib

    run_id = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    run = wandb.init(
        project=project,
        name=os.path.basename(os.path.abspath(run_dir)),
        id=run_id,
        resume="allow",
        dir=run_dir,
        config=config or {},
    )
    run.define_metric("eval/*", step_metric="eval/step")
    return run


def save_config(run_dir: str, cfg) -> None:
    """config.json (read by --resume), config.yaml and config.toml: the same resolved config as
    flags, which ``staleflow train --config RUN/config.yaml`` (or .toml) repeats (config/file.py)."""
    from staleflow.config.file import dump_toml, dump_yaml

    durable.atomic_write_text(
        os.path.join(run_dir, "config.json"), json.dumps(dataclasses.asdict(cfg), indent=2, default=str)
    )
    header = "# The resolved config of this run: staleflow train --config <this file> repeats it.\n"
    durable.atomic_write_text(os.path.join(run_dir, "config.yaml"), dump_yaml(cfg, header))
    durable.atomic_write_text(os.path.join(run_dir, "config.toml"), dump_toml(cfg, header))


def read_jsonl(path: str) -> list[dict]:
    """The rows of a run's JSONL log; a line torn by a crash is skipped (staleflow.durable)."""
    return durable.read_jsonl(path)[0]
