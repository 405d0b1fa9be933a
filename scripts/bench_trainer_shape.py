"""A few decoder layers of a real model's width in the trainer, at the run's micro-batch size: tokens/s
and peak memory beside the memory plan's trainer row for the same shape.

    python scripts/bench_trainer_shape.py                     # GPU: Qwen2.5-7B width, 2 layers, 16k-token micro-batches
    python scripts/bench_trainer_shape.py --device cpu --hidden 64 --layers 2 --micro-batch-tokens 64 --len 16

One unsharded trainer rank (as the plan's single-rank row models it: fp32 master weights, bf16
autocast on CUDA, activation checkpointing auto, the Triton log-prob op on CUDA), random weights
made on the device, --samples trajectories of --len prompt + --len response tokens, so each step
packs (2 x len x samples) / micro-batch-tokens micro-batches. The first step warms up (kernels,
allocator); the rest are timed. The memory plan's row is computed for the same config and shape
without the CUDA context (torch does not count it). Last line: JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_shape import build_model  # noqa: E402

GiB = 2**30


def batch_of(vocab: int, n: int, length: int, seed: int = 0) -> tuple[list, list]:
    """Trainer.step's (groups, payloads): n random trajectories in groups of four (the last may be smaller),
    rewards alternating 0 and 1. The payloads are in no ring, so the
    groups' handles are stand-ins (rank -1): the trainer is given the payloads and never reads them."""
    from staleflow.trajectory import RecordHandle, TrainGroup, TrajectoryTokens

    rng = random.Random(seed)
    groups, payloads = [], []
    for g in range(0, n, 4):
        ids = list(range(g, min(g + 4, n)))
        members = []
        for _ in ids:
            prompt = [rng.randrange(vocab) for _ in range(length)]
            response = [rng.randrange(vocab) for _ in range(length)]
            logps = [-rng.uniform(8.0, 11.0) for _ in range(length)]
            members.append(TrajectoryTokens(prompt, response, logps, [0] * length))
        rewards = [float(i % 2) for i in ids]
        handles = [RecordHandle(-1, 0, 0, 0)] * len(ids)
        groups.append(TrainGroup(g // 4, 0, ids, handles, rewards, [length] * len(ids), length))
        payloads.append(members)
    return groups, payloads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-7B-Instruct", help="architecture (bundled name, alias or folder)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=0, help="shrink the width (CPU smoke)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--len", type=int, default=1024, help="prompt and response tokens of each trajectory")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="steps, the first one untimed")
    ap.add_argument("--validate", action="store_true", help="build the configs and the plan row only (no device)")
    args = ap.parse_args()
    from staleflow.config import RolloutConfig, RunConfig, TrainConfig
    from staleflow.plan.architecture import model_args
    from staleflow.plan.estimate import trainer_rank
    from staleflow.train.parallelize import MASTER_DTYPE
    from staleflow.train.trainer import Trainer

    margs = dataclasses.replace(model_args(args.model), num_layers=args.layers)
    if args.hidden:
        margs = dataclasses.replace(
            margs, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_heads=4, num_kv_heads=2,
            head_dim=args.hidden // 4, vocab_size=min(margs.vocab_size, 1024),
        )  # fmt: skip
    cuda = args.device == "cuda"
    cfg = TrainConfig(lr=1e-6, micro_batch_tokens=args.micro_batch_tokens)
    if args.validate:  # scripts/device_check.sh --dry-run: the configs this run builds, without a device
        run_cfg = RunConfig(
            rollout=RolloutConfig(max_model_len=2 * args.len, max_kv_tokens=max(65536, 2 * args.len)), train=cfg
        )
        plan = trainer_rank(run_cfg, margs, 0, 1, args.device, 0, flash=False)
        print(json.dumps({"validated": ["trainer"], "plan_gib": round(plan.steady / GiB, 3), "ok": True}))
        return 0
    t0 = time.perf_counter()
    model = build_model(margs, args.device, MASTER_DTYPE)
    trainer = Trainer(model, cfg, args.device, max_response_tokens=args.len)
    build_s = time.perf_counter() - t0
    batch = batch_of(margs.vocab_size, args.samples, args.len)
    tokens = sum(t.seq_len for members in batch[1] for t in members)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], {}
    for i in range(args.steps):
        t = time.perf_counter()
        metrics = trainer.step(*batch)
        if cuda:
            torch.cuda.synchronize()
        if i > 0 or args.steps == 1:
            times.append(time.perf_counter() - t)
    step_s = min(times)
    peak = torch.cuda.max_memory_allocated() / GiB if cuda else None
    run_cfg = RunConfig(
        rollout=RolloutConfig(max_model_len=2 * args.len, max_kv_tokens=max(65536, 2 * args.len)), train=cfg
    )
    plan = trainer_rank(run_cfg, margs, 0, 1, args.device, 0, flash=False)
    plan_gib = (plan.steady - plan.items.get("contexts", 0)) / GiB
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}; {args.model} width: {margs.num_layers} layers, hidden {margs.hidden_size}, vocab "
          f"{margs.vocab_size} ({params / 1e9:.2f}B params); {args.samples} x {2 * args.len} tokens, micro-batch "
          f"{args.micro_batch_tokens}; built in {build_s:.1f} s")  # fmt: skip
    print(f"step {step_s:.3f} s (best of {len(times)}), {tokens / step_s:.0f} tokens/s, loss {metrics.get('loss'):.4f}")
    print("plan row (GiB): " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.items.items()))
    print(f"peak allocated {peak if peak is None else round(peak, 2)} GiB vs plan {plan_gib:.2f} GiB (no context)")
    out = {
        "device": name,
        "shape": {"layers": margs.num_layers, "hidden": margs.hidden_size, "vocab": margs.vocab_size},
        "params_b": round(params / 1e9, 3),
        "micro_batch_tokens": args.micro_batch_tokens,
        "tokens_per_step": tokens,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "loss": metrics.get("loss"),
        "logprob_impl": trainer.cfg.logprob_impl,
        "activation_checkpointing": bool(trainer.model.gradient_checkpointing),
        "peak_gib": round(peak, 3) if peak is not None else None,
        "plan_gib": round(plan_gib, 3),
        "plan_items_gib": {k: round(v / GiB, 3) for k, v in plan.items.items()},
        "peak_vs_plan": round(peak / plan_gib, 3) if peak is not None else None,
        "ok": bool(metrics) and all(v == v for v in (metrics.get("loss"), metrics.get("grad_norm"))),
    }
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
