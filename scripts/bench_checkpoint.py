"""Benchmark: how long a checkpoint stops training, synchronous save vs the background writer.

    python scripts/bench_checkpoint.py                          # SmolLM2-135M + AdamW state, 3 rounds
    python scripts/bench_checkpoint.py --model tiny-llama --rounds 1   # quick check

One trainer rank (after one optimizer step, so the AdamW state exists) saves its full state into a
temporary folder, alternating in each round: ``save_checkpoint`` (the baseline: training waits
until the files are written, hashed and renamed) and ``begin_save`` + ``finish_save`` (training
waits only for the copy into host memory; the writer thread writes and hashes meanwhile). Reported:
the stall (seconds training cannot run), the time until the background save is in place (a training step ran meanwhile), one training step
alone and one step while the writer runs (the write's cost to training through shared CPU/disk),
and the files' bytes. Every checkpoint is verified. Best of --rounds. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from staleflow.metrics.hardware import cpu_name


def _batch(vocab: int, n_groups: int, length: int, seed: int):
    """Trainer.step's (groups, payloads): groups of two random trajectories, rewards 0 and 1. The payloads are in no ring, so the
    groups' handles are stand-ins (rank -1): the trainer is given the payloads and never reads them."""
    from staleflow.trajectory import RecordHandle, TrainGroup, TrajectoryTokens

    rng = random.Random(seed)
    groups, payloads = [], []
    for g in range(n_groups):
        members = [
            TrajectoryTokens(
                [rng.randrange(vocab) for _ in range(length)],
                [rng.randrange(vocab) for _ in range(length)],
                [-rng.uniform(8.0, 11.0)] * length,
                [0] * length,
            )
            for _ in range(2)
        ]
        ids = [2 * g, 2 * g + 1]
        groups.append(TrainGroup(g, 0, ids, [RecordHandle(-1, 0, 0, 0)] * 2, [0.0, 1.0], [length] * 2, length))
        payloads.append(members)
    return groups, payloads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="", help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    from staleflow.config import TrainConfig
    from staleflow.model import load_model
    from staleflow.train import checkpoint as ck
    from staleflow.train.checkpoint_writer import CheckpointWriter
    from staleflow.train.trainer import Trainer

    trainer = Trainer(load_model(args.model), TrainConfig(lr=1e-5, micro_batch_tokens=512))
    vocab = trainer.model.args.vocab_size
    batch = _batch(vocab, 2, 32, 0)
    trainer.step(*batch)  # AdamW state exists from here on
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    writer = CheckpointWriter()
    rows = {
        "sync_stall_s": [],
        "async_stall_s": [],
        "async_until_durable_s": [],
        "step_alone_s": [],
        "step_during_write_s": [],
    }
    nbytes = 0
    try:
        for _ in range(args.rounds):
            t = time.perf_counter()
            path = ck.save_checkpoint(trainer, root / "sync", keep=1)
            rows["sync_stall_s"].append(time.perf_counter() - t)
            ck.verify_checkpoint(path)
            nbytes = sum(f.stat().st_size for f in path.iterdir())
            t = time.perf_counter()
            trainer.step(*batch)
            rows["step_alone_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            final, _ = ck.begin_save(trainer, root / "async", keep=1, writer=writer)
            rows["async_stall_s"].append(time.perf_counter() - t)
            s = time.perf_counter()
            trainer.step(*batch)  # training goes on while the writer runs
            rows["step_during_write_s"].append(time.perf_counter() - s)
            ck.finish_save(trainer, writer, final)
            rows["async_until_durable_s"].append(time.perf_counter() - t)
            ck.verify_checkpoint(final)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in rows.items()}
    out = {
        "model": args.model,
        "hardware": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "checkpoint_mb": round(nbytes / 1e6, 1),
        **{k: round(v, 4) for k, v in best.items()},
        "stall_ratio_async_vs_sync": round(best["async_stall_s"] / best["sync_stall_s"], 4),
        "step_slowdown_during_write": round(best["step_during_write_s"] / best["step_alone_s"], 3),
        "rounds": args.rounds,
    }
    print(f"{out['hardware']}; {args.model}, checkpoint {out['checkpoint_mb']} MB, best of {args.rounds}")
    print(f"{'':<28}{'seconds':>9}")
    for k in rows:
        print(f"{k:<28}{best[k]:>9.3f}")
    print(f"stall async / sync: {out['stall_ratio_async_vs_sync']:.3f}; a step during the write takes "
          f"{out['step_slowdown_during_write']:.2f}x a step alone")  # fmt: skip
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
