"""Fit the coordinator's cost model to the built-in engine's own profiled decode steps (CPU).

    python scripts/fit_cost_model_cpu.py [--model smollm2-135m] [--out src/staleflow/coordinator/presets/cpu-smollm2.json]

Runs staleflow's BuiltinEngine with ``profile=True`` on batches of n requests (n in --batches)
with prompts of --prompt-lens tokens, greedy, eos ignored, and keeps the pure-decode steps
(CostSample with prefill_tokens == 0: n running, KV tokens, latency), keeping the fastest step of
each configuration (contention on a shared host only adds time). Then fits
latency = k1*KV + max(k2, k3*n + b3) (k4 = 0) with staleflow.coordinator.fit_cost_model and
prints the samples' fit error. The engine's KV capacity (RolloutConfig.max_kv_tokens) is stored.
Last line: JSON with the coefficients.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from staleflow.config import RolloutConfig
from staleflow.coordinator.cost_model import fit_cost_model
from staleflow.model import load_model
from staleflow.rollout import BuiltinEngine, Request, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--prompt-lens", default="32,256")
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args()
    rc = RolloutConfig()
    model = load_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
    print(f"host: {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; model {args.model}; engine max_kv_tokens {rc.max_kv_tokens}")
    samples = []
    for n in map(int, args.batches.split(",")):
        for plen in map(int, args.prompt_lens.split(",")):
            eng = BuiltinEngine(model, max_running=max(n, 1), max_kv_tokens=rc.max_kv_tokens,
                                block_size=rc.block_size, prefill_chunk_tokens=max(rc.prefill_chunk_tokens, n * plen),
                                max_model_len=rc.max_model_len, eos_ids=[], profile=True)
            for r in range(n):
                eng.add(Request(f"r{r}", [(7 * r + j) % 1000 + 10 for j in range(plen)],
                                SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)))
            t0 = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            dec = [s for s in eng.profile_samples if s.prefill_tokens == 0 and s.n_running == n][1:]  # skip warm-up
            if dec:  # the fastest step of a configuration: other jobs on a shared host only add time
                best = min(dec, key=lambda s: s.latency_s)
                samples.append((best.n_running, float(best.kv_tokens), best.latency_s))
            if dec:
                mean = sum(s.latency_s for s in dec) / len(dec)
                print(f"n={n:3d} prompt={plen:4d}  {len(dec)} decode steps, mean {mean * 1e3:8.2f} ms, "
                      f"{n / mean:8.1f} tok/s  ({time.perf_counter() - t0:.1f} s)", flush=True)
    cm = fit_cost_model(samples, rc.max_kv_tokens, name="cpu-smollm2",
                        source=f"scripts/fit_cost_model_cpu.py: BuiltinEngine profile of {args.model} (fp32) on a "
                               f"{os.cpu_count()}-cpu {platform.machine()} host shared with other jobs, "
                               f"{time.strftime('%Y-%m-%d')}; noisy, re-fit on the target machine")
    rel = [abs(cm.step_time(n, kv) - s) / s for n, kv, s in samples]
    print(f"fit: k1={cm.k1:.3e} k2={cm.k2:.3e} k3={cm.k3:.3e} b3={cm.b3:.3e}  "
          f"mean rel err {sum(rel) / len(rel):.1%}, max {max(rel):.1%} over {len(samples)} configurations")
    d = cm.to_dict()
    d["fit"] = {"samples": [[n, kv, round(t, 6)] for n, kv, t in samples], "mean_rel_err": round(sum(rel) / len(rel), 4)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(d, f, indent=2)
            f.write("\n")
    print(json.dumps({k: d[k] for k in ("k1", "k2", "k3", "b3", "k4", "kv_capacity")}))


if __name__ == "__main__":
    main()
