"""Benchmark: prompt prefix sharing within GRPO groups (built-in engine), shared vs unshared.

    python scripts/bench_prefix_sharing.py --threads 1                 # SmolLM2-135M, groups of 4 and 8
    python scripts/bench_prefix_sharing.py --model tiny-llama --prompt-len 64 --new-tokens 4   # quick check

A GRPO-like batch: --groups prompts of --prompt-len random token ids, each requested --group-size
times (seeded sampling at temperature 1, one seed per member, eos ignored so every request
makes --new-tokens tokens), all added at once. The same batch runs on an engine with
prefix_sharing=True and on the baseline (prefix_sharing=False) in this run, alternating for
--repeats rounds so background load hits both alike; the best round of each is reported. Per
group size it prints prefill tokens computed (from the engine's per-step profile), wall time of
the whole batch and the ratios, and how far the outputs agree. They need not be bit-identical:
with fewer prefill tokens the shared engine fits more requests into the first steps' prefill
budget, so its batches (and the GEMMs' float rounding) differ from the baseline's; the log-prob
differences are at that rounding level, and a token differs only where a draw lands that close
to a CDF boundary. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from bench_engine import hardware


def run(model, reqs, sharing: bool, args) -> tuple[float, int, list[list[int]]]:
    """(wall seconds, prefill tokens computed, output ids per request) for one engine run."""
    from staleflow.rollout.builtin_engine import BuiltinEngine

    total = args.prompt_len + args.new_tokens + 1
    eng = BuiltinEngine(
        model,
        max_running=len(reqs),
        max_kv_tokens=len(reqs) * (total + args.block_size),
        block_size=args.block_size,
        prefill_chunk_tokens=args.prefill_chunk,
        max_model_len=total,
        profile=True,
        prefix_sharing=sharing,
    )
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    return (
        dt,
        sum(s.prefill_tokens for s in eng.profile_samples),
        [(o.tokens.response_ids, o.tokens.behaviour_logprobs) for o in outs],
    )


def agreement(a, b) -> tuple[int, float]:
    """(requests with identical tokens, max |log-prob difference| before each pair's first differing token)."""
    same, diff = 0, 0.0
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b):
        same += ids_a == ids_b
        k = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), len(ids_a))
        diff = max([diff] + [abs(x - y) for x, y in zip(lp_a[:k], lp_b[:k])])
    return same, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--group-sizes", default="4,8")
    ap.add_argument("--groups", type=int, default=4, help="distinct prompts per batch")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from staleflow.model import load_model, resolve_model_path
    from staleflow.rollout.engine import Request, SamplingParams

    device = torch.device(args.device)
    model = load_model(resolve_model_path(args.model), dtype=getattr(torch, args.dtype), device=device)
    gen = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.groups)]
    sizes = [int(x) for x in args.group_sizes.split(",")]

    def batch(size):
        return [
            Request(
                g * size + m,
                p,
                SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1000 * g + m),
            )
            for g, p in enumerate(prompts)
            for m in range(size)
        ]

    run(model, batch(2)[:2], True, args)  # warm-up (allocator, first-call costs)
    rows, result = [], {}
    for size in sizes:
        reqs = batch(size)
        best = {True: (float("inf"), 0, None), False: (float("inf"), 0, None)}
        for _ in range(args.repeats):
            for sharing in (False, True):
                dt, prefill, ids = run(model, reqs, sharing, args)
                if dt < best[sharing][0]:
                    best[sharing] = (dt, prefill, ids)
        (t_base, p_base, out_base), (t_new, p_new, out_new) = best[False], best[True]
        same, dlp = agreement(out_base, out_new)
        result.update(
            {
                f"g{size}_prefill_tokens": p_new,
                f"g{size}_prefill_tokens_baseline": p_base,
                f"g{size}_wall_s": round(t_new, 3),
                f"g{size}_wall_s_baseline": round(t_base, 3),
                f"g{size}_speedup": round(t_base / t_new, 2),
                f"g{size}_same_tokens": f"{same}/{len(reqs)}",
                f"g{size}_max_dlogprob": float(f"{dlp:.2e}"),
            }
        )
        rows.append(
            (
                f"group size {size} ({len(reqs)} requests)",
                f"prefill tokens {p_base} -> {p_new} ({p_base / max(p_new, 1):.2f}x fewer); wall "
                f"{t_base:.2f} s -> {t_new:.2f} s ({t_base / t_new:.2f}x)",
            )
        )
        rows.append(
            (
                "  outputs vs baseline",
                f"identical tokens in {same}/{len(reqs)} requests, max |dlogprob| "
                f"{dlp:.1e} before the first differing token",
            )
        )

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    head = [
        ("hardware", hardware(device)),
        ("torch / python", f"{torch.__version__} / {platform.python_version()}"),
        ("load average (1 min)", f"{load:.1f}"),
        ("model / dtype", f"{args.model} / {args.dtype}"),
        (
            "batch",
            f"{args.groups} prompts x group size, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
            f"T=1 seeded, block {args.block_size}, chunk {args.prefill_chunk}",
        ),
        (
            "baseline",
            f"the same engine with prefix_sharing=False, this run; best of {args.repeats} alternating rounds each",
        ),
    ]
    width = max(len(k) for k, _ in head + rows)
    for k, v in head + rows:
        print(f"{k:<{width}}  {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
