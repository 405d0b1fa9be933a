"""Fit the coordinator's cost model to CPU decode steps of a SmolLM2-135M-shaped model.

    python scripts/fit_cost_model_cpu.py [--out src/staleflow/coordinator/presets/cpu-smollm2.json]

A stand-in until the built-in engine's own profiling exists: it times pure-decode steps of
transformers' LlamaForCausalLM built from SmolLM2-135M's config (random weights: step time does
not depend on weight values) at batch sizes n and resident KV lengths L, then fits
latency = k1*KV + max(k2, k3*n + b3) (+ k4 = 0) with staleflow.coordinator.fit_cost_model.
Prints the samples, the fit and its error, and a last JSON line with the coefficients.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from staleflow.coordinator.cost_model import fit_cost_model

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)


@torch.inference_mode()
def time_decode(model, n: int, kv_len: int, steps: int) -> float:
    ids = torch.randint(0, 49152, (n, kv_len))
    cache = DynamicCache()
    out = model(input_ids=ids, cache=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    model(input_ids=nxt, cache=cache, use_cache=True)  # warm
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kv-capacity", type=int, default=65536, help="RolloutConfig.max_kv_tokens default")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval()
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    samples = []
    for n in (1, 2, 4, 8, 16):
        for kv_len in (32, 512):
            s = time_decode(model, n, kv_len, args.steps)
            samples.append((n, float(n * kv_len), s))
            print(f"n={n:3d} kv_len={kv_len:5d} KV={n * kv_len:6d}  step {s * 1e3:8.2f} ms  {n / s:8.1f} tok/s")
    cm = fit_cost_model(samples, args.kv_capacity, name="cpu-smollm2",
                        source=f"scripts/fit_cost_model_cpu.py on {os.cpu_count()}-cpu host, transformers "
                               f"LlamaForCausalLM (SmolLM2-135M shape, fp32, eager), {time.strftime('%Y-%m-%d')}; "
                               "a stand-in for the built-in engine's profile")
    rel = [abs(cm.step_time(n, kv) - s) / s for n, kv, s in samples]
    print(f"fit: k1={cm.k1:.3e} k2={cm.k2:.3e} k3={cm.k3:.3e} b3={cm.b3:.3e}  "
          f"mean rel err {sum(rel) / len(rel):.1%}, max {max(rel):.1%}")
    d = cm.to_dict()
    d["fit"] = {"samples": [[n, kv, s] for n, kv, s in samples], "mean_rel_err": sum(rel) / len(rel)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(d, f, indent=2)
            f.write("\n")
    print(json.dumps({k: d[k] for k in ("k1", "k2", "k3", "b3", "k4", "kv_capacity")}))


if __name__ == "__main__":
    main()
