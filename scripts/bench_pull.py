"""Benchmark: a rollout rank's weight pull, through a staging copy (before issue 19) vs straight into
the engine's parameters (now), on one machine.

    python scripts/bench_pull.py                      # SmolLM2-135M, fp32 and bf16 engines, CPU
    python scripts/bench_pull.py --model tiny-llama --reps 3

For each engine dtype the Parameter Server slot holds what the runtime writes into it:
  before   fp32 slot -> pull into a staging dict (layout.empty()) -> engine.load_weights(staging)
           (a second copy, and the cast to the engine's dtype there)
  now      slot in the engine's dtype (cluster.placement.slot_dtype) -> pull straight into the engine's
           parameters -> engine.load_weights(params) (validation and bookkeeping; the copy onto
           itself is free)
Prints median seconds per pull (after one warm-up), bytes moved, the ratio, and a last JSON line.
Threads: torch.get_num_threads() (set OMP_NUM_THREADS). On CUDA (--device cuda) the engine and
the slot are on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid

import torch


def _time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(model_name: str, dtype: torch.dtype, device: str, reps: int) -> dict:
    from staleflow.model import load_model
    from staleflow.rollout.builtin_engine import BuiltinEngine
    from staleflow.servers import ParameterServer, ParamLayout

    engine = BuiltinEngine(
        load_model(model_name, dtype=dtype, device=device),
        max_kv_tokens=4096,
        max_model_len=512,
        decode_backend="gather",
    )
    master = load_model(model_name, dtype=torch.float32, device=device)
    out = {"model": model_name, "engine_dtype": str(dtype).removeprefix("torch."), "device": device}
    version = [0]
    for how, slot_dtype in (("before", torch.float32), ("now", dtype)):
        run = "bp" + uuid.uuid4().hex[:8]
        layout = ParamLayout.from_named_tensors(master.named_parameters(), dtype=slot_dtype)
        ps = ParameterServer.create(run, layout, device=device, readers=1)
        reader = ParameterServer.attach(run, reader=0) if device == "cuda" else ps
        ps.begin_push(1)
        for name, p in master.named_parameters():
            ps.write_shard(name, p.detach())
        ps.publish(1)
        staging = layout.empty(device)
        targets = dict(engine.model.named_parameters())

        def pull():
            version[0] += 1
            if how == "before":
                v, tensors = reader.pull_latest(out=staging)
            else:
                v, tensors = reader.pull_latest(out=targets)
            engine.load_weights(tensors, version[0])

        out[f"{how}_s"] = _time(pull, reps)
        out[f"{how}_slot_mb"] = round(layout.nbytes / 2**20, 1)
        if reader is not ps:
            reader.close()
        ps.close()
    out["speedup"] = round(out["before_s"] / out["now_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, device {args.device}"
    )
    rows = [bench(args.model, dt, args.device, args.reps) for dt in (torch.float32, torch.bfloat16)]
    print(f"{'engine':>8} {'slot before':>12} {'before s':>9} {'slot now':>9} {'now s':>7} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['engine_dtype']:>8} {r['before_slot_mb']:>9.0f} MB {r['before_s']:>9.3f} {r['now_slot_mb']:>6.0f} MB "
            f"{r['now_s']:>7.3f} {r['speedup']:>5.2f}x"
        )
    print(json.dumps({"bench": "pull", "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
