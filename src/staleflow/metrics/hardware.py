"""What a benchmark runs on, for the header line every benchmark prints (CONVENTIONS: every
number states its hardware)."""

from __future__ import annotations

import platform


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
