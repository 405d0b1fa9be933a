"""Trainer step time: fp32 against bf16 autocast (--train.compute-dtype) on this machine, same run.

    python scripts/bench_train_step.py [--model smollm2-135m] [--groups 2] [--group-size 8] [--len 96] [--threads 1]

Builds the Trainer on the model with GRPO samples of the default task's shape (prompt ~40 tokens,
responses of --len tokens, rewards 0/1 within each group), runs --repeats optimizer steps per
compute dtype from the same initial weights, and prints the median step time of each, the
ratio, and how far bf16's current-policy log-probs (before the update) are from fp32's (what the
PPO ratio would see). Last line: JSON. The baseline (fp32) is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from staleflow.metrics.hardware import cpu_flags, cpu_name


def batch_of(n_groups: int, group_size: int, resp_len: int, vocab: int, seed: int) -> tuple[list, list]:
    """Trainer.step's (groups, payloads): n_groups groups of group_size random trajectories sharing
    a 40-token prompt, rewards alternating 0 and 1. The payloads are in no ring, so the
    groups' handles are stand-ins (rank -1): the trainer is given the payloads and never reads them."""
    from staleflow.trajectory import RecordHandle, TrainGroup, TrajectoryTokens

    rng = random.Random(seed)
    groups, payloads = [], []
    for g in range(n_groups):
        prompt = [rng.randrange(100, vocab) for _ in range(40)]
        members = []
        for _ in range(group_size):
            n = max(4, int(rng.gauss(resp_len, resp_len / 4)))
            members.append(
                TrajectoryTokens(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(100, vocab) for _ in range(n)],
                    behaviour_logprobs=[-1.0] * n,
                    versions=[0] * n,
                )
            )
        groups.append(
            TrainGroup(
                group_id=g,
                traj_version=0,
                traj_ids=[g * group_size + k for k in range(group_size)],
                handles=[RecordHandle(-1, 0, 0, 0)] * group_size,
                rewards=[float(k % 2) for k in range(group_size)],
                n_tokens=[len(t.response_ids) for t in members],
                prompt_len=len(prompt),
            )
        )
        payloads.append(members)
    return groups, payloads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from staleflow.config import TrainConfig
    from staleflow.model import load_model
    from staleflow.train.trainer import Trainer

    base = load_model(args.model)
    groups, payloads = batch_of(args.groups, args.group_size, args.len, base.args.vocab_size, seed=0)
    flat = [t for members in payloads for t in members]  # the trainer's member order
    tokens = sum(t.seq_len for t in flat)
    print(
        f"hardware: {cpu_name()} ({cpu_flags()}), {os.cpu_count()} cpus, {args.threads} torch threads, "
        f"torch {torch.__version__}; {args.model}, {len(flat)} samples, {tokens} tokens per step",
        flush=True,
    )
    times, logps = {}, {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(args.model)
        trainer = Trainer(model, TrainConfig(lr=1e-5, micro_batch_tokens=4096, compute_dtype=dtype))
        trainer._oversize = 0  # _plan counts oversize sequences per step
        mbs = trainer._plan(flat, list(range(len(flat))), [0.0] * len(flat))
        with torch.no_grad():
            logps[dtype] = torch.cat([trainer._forward(trainer.policy, mb)[0] for mb in mbs]).float()
        steps = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            trainer.step(groups, payloads)
            steps.append(time.perf_counter() - t0)
        times[dtype] = statistics.median(steps)
        print(f"  {dtype:9s} step {times[dtype]:6.2f} s  (runs: {', '.join(f'{x:.2f}' for x in steps)})", flush=True)
    diff = (logps["bfloat16"] - logps["float32"]).abs()
    out = {
        "fp32_step_s": round(times["float32"], 3),
        "bf16_step_s": round(times["bfloat16"], 3),
        "speedup": round(times["float32"] / times["bfloat16"], 3),
        "logp_abs_diff_mean": float(diff.mean()),
        "logp_abs_diff_max": float(diff.max()),
    }
    print(
        f"bf16 autocast: {out['speedup']:.2f}x the fp32 step; current-policy log-prob difference mean "
        f"{out['logp_abs_diff_mean']:.2e}, max {out['logp_abs_diff_max']:.2e}"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
