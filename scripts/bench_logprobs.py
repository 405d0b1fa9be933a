"""Benchmark: packed log-probs + entropy, chunked autograd path vs the naive [T, V] logits path.

    python scripts/bench_logprobs.py                       # T=8192, V=49152, H=576 (SmolLM2), CPU
    python scripts/bench_logprobs.py --tokens 2048 --impls chunked naive triton --device cuda

Each implementation runs forward + backward (loss = sum(logp) + 0.1 * sum(entropy)) in its own
subprocess, so peak memory is measured cleanly: on CPU the extra peak is the process's high-water
RSS minus its RSS after the inputs were built; on CUDA, torch.cuda.max_memory_allocated minus
the allocation before the op (children run with MALLOC_MMAP_THRESHOLD_=65536 so that RSS
tracks live memory). The first timed run is also the memory run; `--repeats` more runs
give the median time. Prints hardware, shapes, a table and, last, one JSON line with
mem_ratio_vs_naive (naive extra peak / chunked extra peak) and time_ratio_vs_naive
(chunked time / naive time; > 1 means chunked is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> None:
    import torch

    from staleflow.train.logprobs import packed_logprobs

    dev = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(dev, dtype).requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(dev)

    def run():
        lp, ent = packed_logprobs(h, w, y, impl=args.impl)
        (lp.sum() + 0.1 * ent.sum()).backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return lp

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    t0 = time.perf_counter()
    lp = run()
    first = time.perf_counter() - t0
    if dev.type == "cuda":
        extra = torch.cuda.max_memory_allocated() - base
    else:
        extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times = [first]
    for _ in range(args.repeats):
        h.grad = w.grad = None
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "impl": args.impl,
                "extra_peak_bytes": extra,
                "time_s": statistics.median(times),
                "times": times,
                "logp_sum": float(lp.double().sum()),
                "dh_norm": float(h.grad.double().norm()),
                "dw_norm": float(w.grad.double().norm()),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impls", nargs="+", default=["chunked", "naive"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if "naive" not in args.impls or args.impls[0] == "naive":
        p.error("--impls must list the implementation under test first and include naive (the baseline)")

    import torch

    print(
        f"# host: {platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    if args.device.startswith("cuda"):
        print(f"# device: {torch.cuda.get_device_name()}")
    print(
        f"# shapes: T={args.tokens} V={args.vocab} H={args.hidden} dtype={args.dtype} device={args.device}; "
        f"op = forward + backward of sum(logp) + 0.1 sum(entropy)"
    )
    results = {}
    for impl in args.impls:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--impl",
            impl,
            "--tokens",
            str(args.tokens),
            "--vocab",
            str(args.vocab),
            "--hidden",
            str(args.hidden),
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--repeats",
            str(args.repeats),
        ]
        # Fixed mmap threshold: freed big blocks go back to the OS, so RSS tracks live memory
        # (glibc's dynamic threshold would otherwise keep freed chunks resident in the heap).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            sys.exit(f"{impl} failed (exit {out.returncode}): {out.stderr[-2000:]}")
        results[impl] = json.loads(out.stdout.strip().splitlines()[-1])
    logits_bytes = args.tokens * args.vocab * 4
    print(f"{'impl':>8} {'extra peak MiB':>15} {'x fp32 logits':>14} {'time s':>8}")
    for impl, r in results.items():
        print(
            f"{impl:>8} {r['extra_peak_bytes'] / 2**20:>15.1f} {r['extra_peak_bytes'] / logits_bytes:>14.2f} "
            f"{r['time_s']:>8.2f}"
        )
    base, test = results["naive"], results[args.impls[0]]
    rel = max(abs(test[k] - base[k]) / max(abs(base[k]), 1e-12) for k in ("logp_sum", "dh_norm", "dw_norm"))
    print(f"# max relative difference vs naive (sum logp, |dh|, |dW|): {rel:.2e}")
    print(
        json.dumps(
            {
                "impl": args.impls[0],
                "tokens": args.tokens,
                "vocab": args.vocab,
                "hidden": args.hidden,
                "device": args.device,
                "dtype": args.dtype,
                "extra_peak_mib": round(test["extra_peak_bytes"] / 2**20, 1),
                "naive_extra_peak_mib": round(base["extra_peak_bytes"] / 2**20, 1),
                "time_s": round(test["time_s"], 3),
                "naive_time_s": round(base["time_s"], 3),
                "mem_ratio_vs_naive": round(base["extra_peak_bytes"] / max(test["extra_peak_bytes"], 1), 2),
                "time_ratio_vs_naive": round(test["time_s"] / base["time_s"], 3),
                "max_rel_diff": rel,
            }
        )
    )


if __name__ == "__main__":
    main()
