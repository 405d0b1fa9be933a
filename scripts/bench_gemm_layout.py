"""Benchmark: the decode-step GEMMs of a model in the layouts an engine could use, same run.

    python scripts/bench_gemm_layout.py                      # SmolLM2-135M shapes, fp32 and bf16, M = 32

Per dtype, every layer's projections are timed as a rollout engine would run them at decode batch
M, with one distinct weight per layer so the weights stream from memory as in a real step:
- linear: 7 `F.linear` per layer on the [out, in] weights (what transformers runs; the baseline);
- fused mm: q|k|v and gate|up concatenated, all stored [in, out], 4 `torch.mm` per layer (what
  BuiltinEngine ran before issue 27);
- fused linear: the same fused matrices stored [out, in] (HF's orientation), 4 `F.linear` per layer
  (`CausalLM.fuse_projections` now: every parameter a contiguous row block, so pulls are plain copies);
- oneDNN prepacked: the fused weights reordered once by `mkldnn._reorder_linear_weight` (bf16: skipped,
  with the reason, on a CPU without avx_ne_convert or AVX-512 BW/VL/DQ: metrics.hardware.bf16_prepack_missing);
- MKL prepacked (fp32 only): `mkl._mkl_reorder_linear_weight` at M, and used at another M too.
CPU time, best of --repeats. Last line: JSON with the ratios vs linear.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from staleflow.metrics.hardware import best_cpu_s, bf16_prepack_missing
from staleflow.model import ModelArgs, resolve_model_path
from staleflow.model.hf import read_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--m", type=int, default=32, help="decode batch (rows of x)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    a = ModelArgs.from_hf_config(read_config(resolve_model_path(args.model)))
    h, i, nq, nkv = a.hidden_size, a.intermediate_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    sep = [(nq, h), (nkv, h), (nkv, h), (h, nq), (i, h), (i, h), (h, i)]  # q k v o gate up down, [out, in]
    fused = [(h, nq + 2 * nkv), (nq, h), (h, 2 * i), (i, h)]  # qkv o gate_up down, [in, out]
    result, rows, skipped = {}, [], {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        w_sep = [[torch.randn(s, generator=g).to(dtype) for s in sep] for _ in range(a.num_layers)]
        w_fused = [[torch.randn(s, generator=g).to(dtype) for s in fused] for _ in range(a.num_layers)]
        xs = {n: torch.randn(args.m, n).to(dtype) for n in (h, nq, i)}
        times = {
            "linear": best_cpu_s(lambda: [F.linear(xs[w.shape[1]], w) for ws in w_sep for w in ws], args.repeats),
            "fused mm": best_cpu_s(lambda: [torch.mm(xs[w.shape[0]], w) for ws in w_fused for w in ws], args.repeats),
        }
        w_rows = [[w.t().contiguous() for w in ws] for ws in w_fused]  # the same matrices, [out, in]
        times["fused linear"] = best_cpu_s(
            lambda: [F.linear(xs[w.shape[1]], w) for ws in w_rows for w in ws], args.repeats
        )
        missing = bf16_prepack_missing() if dtype == torch.bfloat16 else None
        if missing:  # not every x86-64 CPU has the instructions oneDNN's bf16 reorder needs
            skipped[f"{str(dtype).removeprefix('torch.')}:oneDNN prepacked"] = missing
        else:
            packed = [
                [torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), args.m) for w in ws] for ws in w_fused
            ]
            times["oneDNN prepacked"] = best_cpu_s(
                lambda: [
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[0]], p, None, "none", [], "")
                    for ws, ps in zip(w_fused, packed)
                    for w, p in zip(ws, ps)
                ],
                args.repeats,
            )
        if dtype == torch.float32:
            orig = [[w.t().contiguous() for w in ws] for ws in w_fused]
            mkl = [[torch.ops.mkl._mkl_reorder_linear_weight(w, args.m) for w in ws] for ws in orig]
            for label, m in (
                ("MKL prepacked", args.m),
                (f"MKL prepacked, used at M={args.m // 2 + 1}", args.m // 2 + 1),
            ):
                xm = {n: torch.randn(m, n) for n in (h, nq, i)}
                times[label] = best_cpu_s(
                    lambda: [
                        torch.ops.mkl._mkl_linear(xm[o.shape[1]], p, o, None, args.m)
                        for os_, ps in zip(orig, mkl)
                        for o, p in zip(os_, ps)
                    ],
                    args.repeats,
                )
        name = str(dtype).removeprefix("torch.")
        for k, t in times.items():
            rows.append((name, k, t, times["linear"] / t))
            result[f"{name}:{k}"] = round(times["linear"] / t, 2)
    print(
        f"{args.model}: {a.num_layers} layers, hidden {h}, intermediate {i}, M = {args.m}, {args.threads} thread(s), "
        f"{os.cpu_count()} cores, torch {torch.__version__}; CPU ms per decode step's projections (no LM head)"
    )
    for name, k, t, r in rows:
        print(f"{name:9s} {k:32s} {t * 1e3:8.1f} ms  {r:5.2f}x vs linear")
    for key, why in skipped.items():
        print(f"{key.replace(':', ' ', 1):42s} skipped: {why}")
    print(json.dumps({**result, **({"skipped": skipped} if skipped else {})}))


if __name__ == "__main__":
    main()
