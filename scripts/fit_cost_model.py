"""Profile the built-in engine and fit the decode cost model T = n / (k1*KV + max(k2, k3*n + b3)).

    python scripts/fit_cost_model.py                                   # SmolLM2-135M on this machine
    python scripts/fit_cost_model.py --out src/staleflow/coordinator/presets/cpu-smollm2.json
    python scripts/fit_cost_model.py --samples run/cost_samples.jsonl  # fit recorded samples only
    python scripts/fit_cost_model.py --samples device/cost_samples.jsonl --profile h100 --preset qwen2.5-7b-tp1 \
        --kv-capacity 917504   # refit a simulator hardware profile from a device run's samples

Profiling runs BuiltinEngine(profile=True) over a grid of batch sizes (--batches) and prompt
lengths (--prompt-lens) so n and KV vary independently, greedy with eos ignored, and keeps the
pure-decode steps (the first decode step of each cell is dropped as warm-up). The samples can
be saved (--save-samples) and re-fitted later. The fit is the project's one fitter,
staleflow.coordinator.fit_cost_model (relative residuals, robust to steps slowed by other jobs).
Output JSON: k1, k2, k3, b3, k4 = 0 (seconds, per KV token / per sequence) and kv_capacity (a
coordinator preset: load_cost_model reads it), plus model, dtype, hardware, date and fit
error. Last line: the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from staleflow.coordinator.cost_model import fit_cost_model, fit_error
from staleflow.metrics.hardware import cpu_name
from staleflow.rollout.engine import CostSample


def profile(args) -> list[CostSample]:
    from staleflow.model import load_model
    from staleflow.rollout.builtin_engine import BuiltinEngine
    from staleflow.rollout.engine import Request, SamplingParams

    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=torch.device(args.device))
    vocab = model.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    samples: list[CostSample] = []
    for n in map(int, args.batches.split(",")):
        for plen in map(int, args.prompt_lens.split(",")):
            eng = BuiltinEngine(
                model,
                max_running=n,
                max_kv_tokens=args.kv_capacity,
                block_size=16,
                prefill_chunk_tokens=n * plen,
                max_model_len=plen + args.decode_steps + 2,
                profile=True,
            )
            params = SamplingParams(temperature=0, max_new_tokens=args.decode_steps + 1, ignore_eos=True)
            for r in range(n):
                eng.add(Request(r, torch.randint(100, vocab, (plen,), generator=gen).tolist(), params))
            t0 = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            dec = [s for s in eng.profile_samples if s.prefill_tokens == 0 and s.n_running == n][1:]
            samples.extend(dec)
            if dec:
                mean = sum(s.latency_s for s in dec) / len(dec)
                print(
                    f"n={n:3d} prompt={plen:4d}: {len(dec)} decode steps, mean {mean * 1e3:7.1f} ms/step, "
                    f"{n / mean:7.1f} tok/s ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,4,8,16,32,48")
    ap.add_argument("--prompt-lens", default="32,512")
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--kv-capacity", type=int, default=32768, help="engine KV tokens (stored as kv_capacity)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--samples", default="", help="fit these JSONL CostSamples instead of profiling")
    ap.add_argument("--save-samples", default="", help="write the profiled samples as JSONL")
    ap.add_argument("--out", default="", help="write the coefficients JSON here")
    ap.add_argument(
        "--profile",
        default="",
        help="refit a simulator hardware profile: with --preset P (a coordinator preset, e.g. qwen2.5-7b-tp1) "
        "write presets/P-<profile>.json (h100, h200) or overwrite presets/P.json (h20, the fit's own); the "
        "simulator's --hardware <profile> then uses it instead of rescaling the H20 fit (sim/hardware.py)",
    )
    ap.add_argument("--preset", default="", help="the cost-model preset --profile refits")
    args = ap.parse_args()
    if args.profile:
        from staleflow.coordinator.cost_model import PRESET_DIR, preset_names
        from staleflow.sim.hardware import FIT_PROFILE, PROFILES

        if args.profile not in PROFILES or args.preset not in preset_names():
            raise SystemExit(
                f"--profile {args.profile!r} / --preset {args.preset!r}: give a profile of {', '.join(PROFILES)} "
                f"and a preset of {', '.join(preset_names())}"
            )
        name = args.preset if args.profile == FIT_PROFILE else f"{args.preset}-{args.profile}"
        args.out = args.out or str(PRESET_DIR / f"{name}.json")
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.samples:
        with open(args.samples) as f:
            samples = [CostSample(**json.loads(line)) for line in f if line.strip()]
    else:
        samples = profile(args)
    if args.save_samples:
        with open(args.save_samples, "w") as f:
            for s in samples:
                f.write(json.dumps({k: getattr(s, k) for k in CostSample.__slots__}) + "\n")
    dec = [
        (s.n_running, float(s.kv_tokens), s.latency_s)
        for s in samples
        if s.prefill_tokens == 0 and s.n_running > 0 and s.latency_s > 0
    ]
    fit = fit_cost_model(dec, args.kv_capacity)
    mean_err, max_err = fit_error(fit, dec)
    hw = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    )
    out = {
        "name": args.preset or f"{args.device.split(':')[0]}-{args.model}",
        "k1": fit.k1,
        "k2": fit.k2,
        "k3": fit.k3,
        "b3": fit.b3,
        "k4": fit.k4,
        "kv_capacity": args.kv_capacity,
        "model": args.model,
        "dtype": args.dtype,
        "hardware": hw,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "load_average_1min": round(os.getloadavg()[0], 1),
        "fit": {"samples": len(dec), "mean_rel_err": round(mean_err, 4), "max_rel_err": round(max_err, 4)},
        "source": "scripts/fit_cost_model.py: BuiltinEngine(profile=True) pure-decode steps, "
        "staleflow.coordinator.fit_cost_model of latency = k1*KV + max(k2, k3*n + b3) "
        "(relative residuals, soft-L1)",
    }
    print(
        f"fit: k1={fit.k1:.3e} s/KV-token  k2={fit.k2:.3e} s  k3={fit.k3:.3e} s/seq  b3={fit.b3:.3e} s  "
        f"mean rel err {mean_err:.1%} (max {max_err:.1%}) over {len(dec)} steps"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
