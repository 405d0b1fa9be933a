"""What a benchmark runs on, for the header line every benchmark prints (CONVENTIONS: every
number states its hardware)."""

from __future__ import annotations

import platform
import time


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (else what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(wanted: tuple[str, ...] = ("avx512f", "avx512_bf16", "amx_bf16")) -> str:
    """The ones of `wanted` this CPU has (bf16 matmul support decides CPU training speed)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "?"
    return " ".join(w for w in wanted if w in flags) or f"none of {'/'.join(wanted)}"


def bf16_prepack_missing() -> str | None:
    """None when oneDNN can prepack a bf16 linear weight on this CPU (``mkldnn._reorder_linear_weight``),
    else the reason, naming the missing feature: it needs avx_ne_convert or avx512bw + avx512vl +
    avx512dq, which not every x86-64 CPU has (an AMD EPYC without AVX-512 raises). Probed by trying it."""
    import torch

    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 4)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        lines = str(e).strip().splitlines()
        return f"this CPU cannot prepack bf16 weights ({lines[0][:160] if lines else type(e).__name__})"
    return None


def best_cpu_s(fn, repeats: int) -> float:
    """The least CPU seconds (this process, all its threads) of `repeats` calls of fn after one warm-up call: the
    benchmarks' timer on a shared machine, where wall time measures the neighbours too."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best
