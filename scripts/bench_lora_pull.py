"""Benchmark: bytes and time of one rollout weight pull, full-weight training vs LoRA (merged projections).

    python scripts/bench_lora_pull.py                      # SmolLM2-135M, fp32 and bf16 engines, CPU
    python scripts/bench_lora_pull.py --model tiny-llama --reps 1

A full-weight run's Parameter Server slot holds every parameter; a LoRA run's holds only the adapted
projections' merged weights W + (alpha / r) B A (train/lora.py: nothing else changes, so the rollout
rank keeps the rest as it loaded it from --model.path). For each engine dtype and each target set
(attention q k v o, PEFT's common choice; all seven projections) the script pushes what the runtime
pushes into a real Parameter Server (shared memory on CPU), pulls it straight into a BuiltinEngine
the way LocalWeights does, checks that the engine then holds exactly the merged weights (rounded to
its dtype) and prints the slot bytes per pull, the median seconds per pull (after one warm-up), the
ratios against the full pull measured in the same run, the hardware and a last JSON line.
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

TARGETS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "all": None}


def _time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pull_once(
    engine, named: list[tuple[str, torch.Tensor]], dtype, reps: int, version: list[int]
) -> tuple[int, float]:
    """Push ``named`` into a fresh Parameter Server in ``dtype`` and time pulls into ``engine``."""
    from staleflow.servers import ParameterServer, ParamLayout
    from staleflow.servers.weights import slot_targets

    layout = ParamLayout.from_named_tensors(named, dtype=dtype)
    ps = ParameterServer.create("bl" + uuid.uuid4().hex[:8], layout, device="cpu", readers=1)
    try:
        ps.begin_push(1)
        for name, t in named:
            ps.write_shard(name, t)
        ps.end_push()
        ps.publish(1)
        targets, strict = slot_targets(dict(engine.model.named_parameters()), layout)

        def pull():
            version[0] += 1
            v, tensors = ps.pull_latest(out=targets)
            engine.load_weights(tensors, version[0], **({} if strict else {"strict": False}))

        return layout.nbytes, _time(pull, reps)
    finally:
        ps.close()


def bench(model_name: str, dtype: torch.dtype, reps: int, rank: int) -> list[dict]:
    from staleflow.config import LoraConfig
    from staleflow.config.lora import LORA_TARGETS
    from staleflow.model import load_model
    from staleflow.rollout.builtin_engine import BuiltinEngine
    from staleflow.train.lora import apply_lora, lora_init, lora_shards

    engine = BuiltinEngine(load_model(model_name, dtype=dtype), max_kv_tokens=4096, max_model_len=512)
    version = [0]
    master = load_model(model_name)  # the trainer's fp32 weights
    full_bytes, full_s = _pull_once(
        engine, [(n, p.detach()) for n, p in master.named_parameters()], dtype, reps, version
    )
    rows = [{"engine_dtype": str(dtype).removeprefix("torch."), "pull": "full", "mb": full_bytes / 2**20, "s": full_s}]
    for label, targets in TARGETS.items():
        lm = load_model(model_name)
        cfg = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=",".join(targets or LORA_TARGETS))
        apply_lora(lm, cfg)
        with torch.no_grad():
            params = dict(lm.named_parameters())
            for name, t in lora_init(lm, seed=1):
                params[name].copy_(t if name.endswith("lora_A.weight") else torch.randn_like(t) * 0.01)  # B != 0
        merged = [(name, t) for name, t, _, _ in lora_shards(lm, 0, 1)]
        nbytes, secs = _pull_once(engine, merged, dtype, reps, version)
        got = dict(engine.model.named_parameters())
        for name, t in merged:  # the engine now runs exactly the merged projections
            assert torch.equal(got[name], t.to(dtype)), name
        rows.append(
            {
                "engine_dtype": str(dtype).removeprefix("torch."),
                "pull": f"lora r{rank} {label}",
                "mb": nbytes / 2**20,
                "s": secs,
                "bytes_ratio": round(nbytes / full_bytes, 4),
                "time_ratio": round(secs / full_s, 3),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, model {args.model}, CPU shared-memory Parameter Server"
    )
    rows = [r for dt in (torch.float32, torch.bfloat16) for r in bench(args.model, dt, args.reps, args.rank)]
    print(f"{'engine':>8} {'pull':>18} {'MB/pull':>9} {'s/pull':>8} {'bytes vs full':>14} {'time vs full':>13}")
    for r in rows:
        print(
            f"{r['engine_dtype']:>8} {r['pull']:>18} {r['mb']:>9.2f} {r['s']:>8.4f} "
            f"{r.get('bytes_ratio', 1.0):>14.4f} {r.get('time_ratio', 1.0):>13.3f}"
        )
    print(json.dumps({"bench": "lora_pull", "model": args.model, "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
