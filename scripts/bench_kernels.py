"""Benchmark: fused Triton LM-head log-prob/entropy vs the chunked PyTorch path and the naive path.

    TRITON_INTERPRET=0 python scripts/bench_kernels.py                 # both real shapes on CUDA
    python scripts/bench_kernels.py --sweep                            # + forward tile-config sweep
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --device cpu --shapes 256x64x1000  # smoke

For each shape (T tokens, H hidden, V vocab; bf16 inputs, all rows selected, temperature 0.9) it
times forward (no grad) and forward+backward (grads for hidden and weight) of:
  triton         staleflow.kernels.logprob.packed_logprobs_triton
  triton-half-prompt  the same with half the rows unselected (512 prompt tokens per 1024)
  chunked-local  a verl-style PyTorch path defined here: per 2048-token chunk fp32 logits, lse,
                 entropy; backward recomputes the chunk and runs two GEMMs (fp32 dW accumulator)
  chunked-train  staleflow.train.logprobs.packed_logprobs(..., impl="chunked") when importable
  naive          full fp32 [T, V] logits + log_softmax; retried at T/8 when it runs out of memory
and prints median time, effective TFLOP/s (2*T*H*V per forward; 8*T*H*V for forward+backward),
peak extra memory above the inputs, the ratios, and a last JSON line. Needs no tyro, no network.
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def _import_kernels():
    """staleflow.kernels from an install, or straight from this checkout (no pip, no network)."""
    try:
        import staleflow.kernels.logprob as kl
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        sys.path.insert(0, str(root / "src"))
        import staleflow

        staleflow.__path__.append(str(root))  # staleflow.kernels -> <root>/kernels
        import staleflow.kernels.logprob as kl
    return kl


kl = _import_kernels()


class ChunkedLogprobs(torch.autograd.Function):
    """Baseline: token-chunked PyTorch log-prob + entropy with recompute in backward."""

    CHUNK = 2048

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        T = hidden.shape[0]
        logp = torch.empty(T, device=hidden.device, dtype=torch.float32)
        ent = torch.empty_like(logp)
        lse_all = torch.empty_like(logp)
        for c0 in range(0, T, ChunkedLogprobs.CHUNK):
            sl = slice(c0, c0 + ChunkedLogprobs.CHUNK)
            z = (hidden[sl] @ weight.t()).float() / temperature  # [C, V]
            lse = torch.logsumexp(z, -1)
            p = torch.exp(z - lse[:, None])
            logp[sl] = z.gather(1, targets[sl, None]).squeeze(1) - lse
            ent[sl] = lse - (p * z).sum(-1)
            lse_all[sl] = lse
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_h):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        tau = ctx.temperature
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        for c0 in range(0, hidden.shape[0], ChunkedLogprobs.CHUNK):
            sl = slice(c0, c0 + ChunkedLogprobs.CHUNK)
            z = (hidden[sl] @ weight.t()).float() / tau
            p = torch.exp(z - lse_all[sl, None])
            ez = (p * z).sum(-1, keepdim=True)
            dz = -g_lp[sl, None] * p - g_h[sl, None] * p * (z - ez)
            dz.scatter_add_(1, targets[sl, None], g_lp[sl, None])
            dz = (dz / tau).to(hidden.dtype)
            dh[sl] = dz @ weight
            dw += (dz.t() @ hidden[sl]).float()
        return dh, dw.to(weight.dtype), None, None


def naive(hidden, weight, targets, temperature, row_mask=None):
    z = (hidden @ weight.t()).float() / temperature  # [T, V] fp32
    logp_all = torch.log_softmax(z, -1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(1, targets[:, None]).squeeze(1), ent


def _impls():
    impls = {
        "triton": lambda h, w, t, tau, m: kl.packed_logprobs_triton(h, w, t, tau, m),
        "triton-half-prompt": lambda h, w, t, tau, m: kl.packed_logprobs_triton(h, w, t, tau, m),
        "chunked-local": lambda h, w, t, tau, m: ChunkedLogprobs.apply(h, w, t, tau),
        "naive": naive,
    }
    try:
        from staleflow.train.logprobs import packed_logprobs

        impls["chunked-train"] = lambda h, w, t, tau, m: packed_logprobs(
            h, w, t, temperature=tau, row_mask=m, impl="chunked"
        )
    except Exception as exc:  # absent, or imports something this machine lacks (e.g. tyro)
        print(f"# chunked-train unavailable: {type(exc).__name__}: {exc}")
    return impls


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, hidden, weight, targets, tau, mask, backward, reps, warmup):
    """Median ms and peak extra bytes (above what is allocated before the first call)."""
    device = hidden.device
    g = torch.Generator(device=device).manual_seed(0)
    g_lp = torch.randn(hidden.shape[0], device=device, generator=g)
    g_h = torch.randn(hidden.shape[0], device=device, generator=g)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(warmup + reps):
        hidden.grad = weight.grad = None
        _sync(device)
        t0 = time.perf_counter()
        if backward:
            lp, ent = fn(hidden, weight, targets, tau, mask)
            torch.autograd.backward([lp, ent], [g_lp, g_h])
        else:
            with torch.no_grad():
                lp, ent = fn(hidden, weight, targets, tau, mask)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        del lp, ent
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    hidden.grad = weight.grad = None
    return statistics.median(times[warmup:]), peak


def _inputs(T, H, V, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16
    hidden = torch.randn(T, H, device=device, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device=device, generator=g) * (2.0 / math.sqrt(H))).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), device=device, generator=g)
    return hidden, weight, targets


def run_shape(T, H, V, device, impls, reps, warmup, tau=0.9):
    rows = []
    for name, fn in impls.items():
        for backward in (False, True):
            t_used = T
            while True:
                hidden, weight, targets = _inputs(t_used, H, V, device)
                mask = torch.ones(t_used, device=device, dtype=torch.bool)
                if name == "triton-half-prompt":  # 512 prompt + 512 response tokens per 1024
                    mask = torch.arange(t_used, device=device) % 1024 >= 512
                try:
                    ms, peak = measure(fn, hidden, weight, targets, tau, mask, backward, reps, warmup)
                    status = "ok"
                except torch.OutOfMemoryError:
                    ms, peak, status = None, None, "oom"
                except Exception as exc:  # report, keep benchmarking the others
                    ms, peak, status = None, None, f"error: {type(exc).__name__}: {str(exc)[:200]}"
                del hidden, weight, targets, mask
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if status == "oom" and name == "naive" and t_used == T and T >= 8:
                    t_used = T // 8
                    continue
                break
            selected = t_used // 2 if name == "triton-half-prompt" else t_used
            flops = (8 if backward else 2) * selected * H * V  # selected tokens only
            rows.append(
                {
                    "T": t_used,
                    "H": H,
                    "V": V,
                    "impl": name,
                    "mode": "fwd+bwd" if backward else "fwd",
                    "status": status,
                    "ms": ms,
                    "tflops": flops / (ms * 1e-3) / 1e12 if ms else None,
                    "peak_extra_gib": peak / 2**30 if peak is not None else None,
                }
            )
            r = rows[-1]
            print(
                f"T={t_used:6d} H={H:5d} V={V:6d} {name:14s} {r['mode']:8s} "
                + (
                    f"{ms:9.2f} ms {r['tflops']:7.1f} TFLOP/s peak+{r['peak_extra_gib'] or 0:6.2f} GiB"
                    if ms
                    else status
                ),
                flush=True,
            )
    return rows


def sweep(T, H, V, device, reps, warmup):
    """Forward time of a few tile configs (any fixed one is batch invariant; pick the fastest)."""
    # Spill-free on sm_90 with triton 3.9's offline compiler (tests/test_kernels_compile.py method).
    configs = [
        kl.KernelConfig(),  # 128x128x64, 8 warps, 3 stages: 204 regs, 1 CTA/SM
        kl.KernelConfig(num_stages=4),
        kl.KernelConfig(block_k=32, num_stages=4),  # 162 regs
        kl.KernelConfig(block_m=64, num_warps=4, num_stages=3),  # 2 CTAs/SM: epilogue/GEMM overlap
        kl.KernelConfig(block_m=64, num_warps=4, num_stages=4),
        kl.KernelConfig(block_n=256, block_k=32, num_warps=8, num_stages=4),  # 255 regs, no stack
    ]
    hidden, weight, targets = _inputs(T, H, V, device)
    with torch.no_grad():
        ref_lp, ref_ent = kl.packed_logprobs_forward(hidden, weight, targets, 0.9, None)[:2]
    out = []
    for cfg in configs:

        def fn(h, w, t, tau, m, cfg=cfg):
            return kl.packed_logprobs_forward(h, w, t, tau, m, config=cfg)[:2]

        try:
            ms, _ = measure(fn, hidden, weight, targets, 0.9, None, False, reps, warmup)
            tf = 2 * T * H * V / (ms * 1e-3) / 1e12
            with torch.no_grad():
                lp, ent = fn(hidden, weight, targets, 0.9, None)
            diff = max((lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item())
            print(
                f"sweep {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}: "
                f"{ms:8.2f} ms {tf:7.1f} TFLOP/s  max|diff vs default|={diff:.1e}",
                flush=True,
            )
            out.append({"config": cfg.__dict__, "ms": ms, "tflops": tf, "max_diff_vs_default": diff})
        except Exception as exc:
            print(f"sweep {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            out.append({"config": cfg.__dict__, "error": f"{type(exc).__name__}"})
    return out


def _ratio(rows, a, b, mode, T, H, V):
    def pick(name):
        for r in rows:
            if r["impl"] == name and r["mode"] == mode and r["H"] == H and r["V"] == V and r["ms"]:
                return r
        return None

    ra, rb = pick(a), pick(b)
    if not ra or not rb:
        return None
    return (rb["ms"] / rb["T"]) / (ra["ms"] / ra["T"])  # per-token time ratio: >1 means a is faster


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="65536x4096x152064,65536x896x151936", help="TxHxV,...")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sweep", action="store_true", help="also time forward tile configs per shape")
    ap.add_argument("--skip", default="", help="comma-separated impls to skip")
    ap.add_argument("--tests-status", default="not run", help="recorded in the JSON (device_check.sh)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device; use --device cpu with TRITON_INTERPRET=1")
    import triton

    hw = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"# hardware: {hw}; torch {torch.__version__}; triton {triton.__version__}; "
        f"python {platform.python_version()}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}"
    )
    print(f"# kernel config: {kl.default_config(device, torch.bfloat16)}")
    impls = {k: v for k, v in _impls().items() if k not in set(filter(None, args.skip.split(",")))}
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows, sweeps, ratios = [], [], {}
    if args.sweep:
        for shape in shapes:
            sweeps.append({"shape": list(shape), "configs": sweep(*shape, device, args.reps, args.warmup)})
    for T, H, V in shapes:
        rows += run_shape(T, H, V, device, impls, args.reps, args.warmup)
        for mode in ("fwd", "fwd+bwd"):
            for base in ("chunked-local", "chunked-train", "naive"):
                r = _ratio(rows, "triton", base, mode, T, H, V)
                if r is not None:
                    ratios[f"{T}x{H}x{V} {mode} triton vs {base}"] = r
                    print(f"ratio {T}x{H}x{V} {mode}: triton is {r:.2f}x {base}")
    for r in rows:
        if r["impl"] == "triton-half-prompt" and r["ms"]:
            full = [
                q
                for q in rows
                if q["impl"] == "triton"
                and q["mode"] == r["mode"]
                and q["H"] == r["H"]
                and q["V"] == r["V"]
                and q["ms"]
            ]
            if full:  # ~0.5 when masked prompt tokens cost nothing
                ratios[f"{r['T']}x{r['H']}x{r['V']} {r['mode']} half-prompt time / full time"] = r["ms"] / full[0]["ms"]
    big = [r for r in rows if r["impl"] == "triton" and r["mode"] == "fwd" and r["H"] == 4096 and r["ms"]]
    result = {
        "bench": "kernels_logprob",
        "tests": args.tests_status,
        "hardware": hw,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
        "ratios": ratios,
        "sweep": sweeps,
        "target_fwd_550_tflops": (big[0]["tflops"] >= 550) if big else None,
        "target_fwdbwd_2.5x_chunked": {k: v >= 2.5 for k, v in ratios.items() if "fwd+bwd" in k and "chunked" in k},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
