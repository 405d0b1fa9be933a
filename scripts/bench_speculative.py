"""Benchmark: speculative decoding from group siblings (built-in engine), speculative vs plain.

    python scripts/bench_speculative.py                   # SmolLM2-135M: the default task + a 512-token task
    python scripts/bench_speculative.py --quick           # tiny-llama, a few tokens: seconds (the smoke run)

Two workloads, each run on an engine with ``--rollout.speculative.draft-tokens`` (rollout/speculative.py)
and on the baseline (the same engine with speculation off) in this run, alternating for --repeats
rounds so background load hits both alike; the best round of each is reported:

- default: the default task (``--data.source arithmetic``, chat template) at the rollout's defaults:
  temperature 1, max_new_tokens 256, eos stops, GRPO groups of --group-size (seed 1000 * g + member);
- long: --long-groups groups of a story prompt, --long-tokens tokens per response (eos ignored, so
  every response has exactly that many tokens).

At most --group-size requests run at once (one group decodes at a time: the small batch of a tail
lane, where speculation pays; the engine drafts only at <= max_batch decoding sequences). Reported per
workload: ``accepted_per_forward`` (tokens emitted per sequence per forward; 1.0 is plain decoding),
``draft_acceptance``, ``decode_speedup`` (tokens per wall second of the whole batch, speculative / baseline: per token,
since a response that diverged from the baseline's by float rounding has another length; the prefill
is the same work in both), ``cpu_speedup`` (the same ratio of this process's CPU time: with --threads 1
it is the compute, and moves far less than the wall on a shared machine) and ``same_tokens`` (requests whose tokens equal the baseline's: the
verification samples each position with the plain decode's seeded uniform, so they differ only where
float rounding of the wider verification forward moves a draw across a CDF boundary).

``same_distribution`` is the p value of a two-sample chi-square test (metrics.stats.chi2_two_sample)
between --dist-samples responses of --dist-tokens tokens to one fixed prompt from the speculative
engine and as many from the baseline, with DISJOINT seeds (with equal seeds the coupling above makes
the test trivial). A small p (< 0.01) would mean the speculative engine samples another distribution.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from bench_engine import hardware

LONG_PROMPT = "Write a long, detailed story about a robot who learns to cook, with many chapters."


def run(model, reqs, spec, args, max_len: int):
    """((wall s, process CPU s), outputs by request id, speculative stats or None) for one engine run."""
    from staleflow.config.speculative import SpeculativeConfig
    from staleflow.rollout.builtin_engine import BuiltinEngine

    cfg = SpeculativeConfig(draft_tokens=args.draft_tokens, max_batch=args.group_size) if spec else None
    eng = BuiltinEngine(
        model,
        max_running=args.group_size,
        max_kv_tokens=args.group_size * (max_len + 2 * args.block_size),
        block_size=args.block_size,
        max_model_len=max_len,
        speculative=cfg,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    outs = eng.generate(reqs)
    dt = (time.perf_counter() - t0, time.process_time() - c0)
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    return dt, {o.request_id: o.tokens.response_ids for o in outs}, (eng.speculator.stats if spec else None)


def workload(model, name, reqs, args, max_len) -> dict:
    best = {True: None, False: None}
    for _ in range(args.repeats):
        for spec in (False, True):
            got = run(model, reqs, spec, args, max_len)
            if best[spec] is None or got[0][0] < best[spec][0][0]:
                best[spec] = got
    (t_base, out_base, _), (t_spec, out_spec, stats) = best[False], best[True]
    st = stats.as_dict()
    same = sum(out_base[k] == out_spec[k] for k in out_base)
    tokens, tokens_base = (sum(len(v) for v in out.values()) for out in (out_spec, out_base))
    # per token: a response that diverged from the baseline's (float rounding) may be longer or shorter
    ratio = [(tokens / t_spec[j]) / (tokens_base / t_base[j]) for j in (0, 1)]
    return {
        "requests": len(reqs),
        "mean_response_tokens": round(tokens / len(reqs), 1),
        "accepted_per_forward": st["accepted_per_forward"],
        "draft_acceptance": st["draft_acceptance"],
        "tokens": tokens,
        "tokens_baseline": tokens_base,
        "decode_speedup": round(ratio[0], 3),
        "cpu_speedup": round(ratio[1], 3),
        "wall_s": round(t_spec[0], 2),
        "wall_s_baseline": round(t_base[0], 2),
        "cpu_s": round(t_spec[1], 2),
        "cpu_s_baseline": round(t_base[1], 2),
        "same_tokens": f"{same}/{len(reqs)}",
    }


def same_distribution(model, prompt, args) -> dict:
    from staleflow.metrics.stats import chi2_two_sample
    from staleflow.rollout.engine import Request, SamplingParams

    n, samples = args.dist_samples, {}
    for spec, seeds in ((True, range(n)), (False, range(n, 2 * n))):
        reqs = [
            Request(s, prompt, SamplingParams(temperature=1.0, max_new_tokens=args.dist_tokens, seed=s)) for s in seeds
        ]
        _, outs, stats = run(model, reqs, spec, args, len(prompt) + args.dist_tokens + 1)
        samples[spec] = [tuple(outs[s]) for s in seeds]
        if spec:
            acc = stats.as_dict()
    test = chi2_two_sample(samples[True], samples[False])
    return {"p": round(test["p"], 4), "cells": test["cells"], "accepted_per_forward": acc["accepted_per_forward"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", type=int, default=3, help="default-task prompts (GRPO groups)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256, help="default task's max_new_tokens (the rollout default)")
    ap.add_argument("--long-groups", type=int, default=1)
    ap.add_argument("--long-tokens", type=int, default=512)
    ap.add_argument(
        "--long-temperature",
        type=float,
        default=1.0,
        help="0: greedy (--quick: a random model's T=1 text never repeats)",
    )
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--dist-samples", type=int, default=200)
    ap.add_argument("--dist-tokens", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--quick", action="store_true", help="tiny-llama, a few tokens (seconds)")
    args = ap.parse_args()
    if args.quick:
        args.model, args.groups, args.new_tokens, args.long_tokens = "tiny-llama", 1, 12, 16
        args.dist_samples, args.dist_tokens, args.long_temperature, args.threads = 24, 2, 0.0, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    from staleflow.config import DataConfig
    from staleflow.data.render import PromptRenderer
    from staleflow.data.tasks import TASKS
    from staleflow.model import load_model, resolve_model_path
    from staleflow.model.tokenizer import load_tokenizer
    from staleflow.rollout.engine import Request, SamplingParams

    model = load_model(resolve_model_path(args.model), dtype=torch.float32, device=torch.device("cpu"))
    renderer = PromptRenderer(DataConfig(), load_tokenizer(args.model))
    task = TASKS.resolve(DataConfig().source)
    prompts = renderer.encode([task(0, k)[0] for k in range(args.groups)])
    long_prompt = renderer.encode([LONG_PROMPT])[0]
    g = args.group_size

    default_reqs = [
        Request(i * g + m, p, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=1000 * i + m))
        for i, p in enumerate(prompts)
        for m in range(g)
    ]
    long_reqs = [
        Request(
            i * g + m,
            long_prompt,
            SamplingParams(
                temperature=args.long_temperature,
                max_new_tokens=args.long_tokens,
                ignore_eos=True,
                seed=7000 + 1000 * i + m,
            ),
        )
        for i in range(args.long_groups)
        for m in range(g)
    ]
    for spec in (False, True):  # warm-up (allocator, first-call costs)
        run(model, default_reqs[:2], spec, args, max(map(len, prompts)) + args.new_tokens + 1)
    t0 = time.perf_counter()
    default = workload(model, "default", default_reqs, args, max(map(len, prompts)) + args.new_tokens + 1)
    long = workload(model, "long", long_reqs, args, len(long_prompt) + args.long_tokens + 1)
    dist = same_distribution(model, prompts[0], args)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    hw = hardware(torch.device("cpu"))
    result = {
        "accepted_per_forward": default["accepted_per_forward"],
        "decode_speedup": default["decode_speedup"],
        "same_distribution": dist["p"],
        "long_accepted_per_forward": long["accepted_per_forward"],
        "long_decode_speedup": long["decode_speedup"],
        "cpu_speedup": default["cpu_speedup"],
        "long_cpu_speedup": long["cpu_speedup"],
        "default": default,
        "long": long,
        "distribution_test": dist,
        "hardware": hw,
        "torch": torch.__version__,
        "load_avg_1min": round(load, 1),
        "model": args.model,
        "draft_tokens": args.draft_tokens,
        "bench_s": round(time.perf_counter() - t0, 1),
    }
    rows = [
        ("hardware", f"{hw}; torch {torch.__version__} / python {platform.python_version()}; load {load:.1f}"),
        ("model", f"{args.model} fp32; draft tokens {args.draft_tokens}, groups of {g}, at most {g} running"),
        ("baseline", f"the same engine, speculation off, this run; best of {args.repeats} alternating rounds"),
    ]
    for name, w, what in (
        ("default", default, f"arithmetic, T=1, max {args.new_tokens} new tokens, eos stops"),
        (
            "long",
            long,
            f"story prompt, T={args.long_temperature:g}, {args.long_tokens} tokens per response (eos ignored)",
        ),
    ):
        rows.append(
            (
                f"{name} ({what})",
                f"{w['requests']} requests, {w['tokens_baseline']} -> {w['tokens']} tokens; {w['accepted_per_forward']} tokens "
                f"per forward (acceptance {w['draft_acceptance']}); wall {w['wall_s_baseline']} s -> {w['wall_s']} s "
                f"(per token {w['decode_speedup']}x), CPU {w['cpu_s_baseline']} s -> {w['cpu_s']} s ({w['cpu_speedup']}x); same tokens as the baseline {w['same_tokens']}",
            )
        )
    rows.append(
        (
            "same distribution",
            f"chi-square two-sample p = {dist['p']} ({dist['cells']} cells, {args.dist_samples} x {args.dist_tokens}-token "
            f"responses each, disjoint seeds; {dist['accepted_per_forward']} tokens per forward)",
        )
    )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
