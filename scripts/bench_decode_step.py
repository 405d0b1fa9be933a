"""Benchmark: one decode step of the built-in engine, DecodeMirror vs per-step paged gather, and
the sampler's fast draws vs the full-vocabulary definitions.

    python scripts/bench_decode_step.py                           # SmolLM2-135M fp32, 1 thread
    python scripts/bench_decode_step.py --contexts 128,1024 --dtype bfloat16

Decode: for each context length L, --batch sequences with L-token random prompts are prefilled,
then --steps pure decode steps are timed (process CPU time, so background load on other cores
does not count) with decode_mirror on and off, alternating, in this run. Sampler: the same
[batch, V] logits (the model's own next-token logits at temperature 1) through
`draw_chunked` / `draw_truncated` and through the plain definitions (one fp64 cumsum over the
vocabulary; a full sort for top-p). Prints a table and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from staleflow.metrics.hardware import best_cpu_s
from staleflow.model import load_model, resolve_model_path
from staleflow.rollout.builtin_engine import BuiltinEngine
from staleflow.rollout.engine import Request, SamplingParams
from staleflow.rollout.sampler import _draw, draw_chunked, draw_truncated


def decode_step_s(model, prompts, mirror: bool, steps: int) -> float:
    """CPU seconds per pure decode step once every sequence is decoding."""
    longest = max(len(p) for p in prompts) + steps + 8
    eng = BuiltinEngine(
        model,
        max_running=len(prompts),
        max_kv_tokens=len(prompts) * (longest + 16),
        max_model_len=longest,
        prefill_chunk_tokens=4096,
        decode_mirror=mirror,
    )
    params = SamplingParams(temperature=0, max_new_tokens=steps + 4, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add(Request(i, p, params))
    while eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
        eng.step()
    eng.step()  # first decode: the mirror's one-time fill
    t0 = time.process_time()
    for _ in range(steps):
        eng.step()
    return (time.process_time() - t0) / steps


def full_cdf(probs, u):
    return _draw(torch.cumsum(probs.double(), -1), u)


def full_sort_top_p(probs, u, top_p):
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    keep = (torch.cumsum(sorted_p.double(), -1) - sorted_p.double()) < top_p[:, None]
    cdf = torch.cumsum(torch.where(keep, sorted_p, 0.0).double(), -1)
    return order.gather(1, _draw(cdf, u)[:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", default="128,512,1024", help="prompt lengths (comma-separated)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model_path(args.model), dtype=getattr(torch, args.dtype), device="cpu")
    vocab = model.args.vocab_size
    gen = torch.Generator().manual_seed(0)

    rows, result = [], {}
    for ctx in [int(x) for x in args.contexts.split(",")]:
        prompts = [torch.randint(100, vocab, (ctx,), generator=gen).tolist() for _ in range(args.batch)]
        gather = decode_step_s(model, prompts, False, args.steps)
        mirror = decode_step_s(model, prompts, True, args.steps)
        rows.append(
            (
                f"decode step, context ~{ctx}",
                f"{gather * 1e3:.1f} ms",
                f"{mirror * 1e3:.1f} ms",
                f"{gather / mirror:.2f}x",
            )
        )
        result[f"mirror_speedup_ctx{ctx}"] = round(gather / mirror, 2)

    # the model's own next-token distributions after one random token (high entropy: the hard
    # case for top-p, where most rows cannot be settled by the 64 most likely tokens)
    ids = torch.randint(100, vocab, (args.batch,), generator=gen)
    with torch.inference_mode():
        probs = model.compute_logits(model(ids, torch.zeros_like(ids), _OneTokenAttention())).softmax(-1)
    u = torch.rand(args.batch, generator=gen, dtype=torch.float64)
    top_p = torch.full((args.batch,), args.top_p, dtype=torch.float64)
    top_k = torch.zeros(args.batch, dtype=torch.long)
    assert torch.equal(draw_chunked(probs, u), full_cdf(probs, u))
    t_plain_ref, t_plain = best_cpu_s(lambda: full_cdf(probs, u), 5), best_cpu_s(lambda: draw_chunked(probs, u), 5)
    t_top_ref = best_cpu_s(lambda: full_sort_top_p(probs, u, top_p), 2)
    t_top = best_cpu_s(lambda: draw_truncated(probs, u, top_k, top_p), 2)
    rows.append(
        (
            f"sample T=1, {args.batch} x {vocab}",
            f"{t_plain_ref * 1e3:.1f} ms",
            f"{t_plain * 1e3:.1f} ms",
            f"{t_plain_ref / t_plain:.2f}x",
        )
    )
    rows.append(
        (
            f"sample top-p {args.top_p}",
            f"{t_top_ref * 1e3:.1f} ms",
            f"{t_top * 1e3:.1f} ms",
            f"{t_top_ref / t_top:.2f}x",
        )
    )
    result.update(sample_speedup=round(t_plain_ref / t_plain, 2), top_p_speedup=round(t_top_ref / t_top, 2))

    cpu = (
        next(
            (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
            platform.processor(),
        )
        if os.path.exists("/proc/cpuinfo")
        else platform.processor()
    )
    print(
        f"hardware: {cpu}, {os.cpu_count()} cores, {args.threads} torch threads; torch {torch.__version__}; "
        f"load {os.getloadavg()[0]:.1f}; model {args.model} {args.dtype}, batch {args.batch}, CPU time per op"
    )
    print(f"{'what':<34} {'baseline':>10} {'new':>10} {'ratio':>7}")
    print(f"{'':<34} {'(gather / full)':>10}")
    for name, a, b, r in rows:
        print(f"{name:<34} {a:>10} {b:>10} {r:>7}")
    print(json.dumps(result))


class _OneTokenAttention:
    """Attention of T independent one-token sequences: each token attends to itself only."""

    def __call__(self, layer_idx, q, k, v):
        group = q.shape[1] // k.shape[1]
        return v.repeat_interleave(group, dim=1)


if __name__ == "__main__":
    main()
