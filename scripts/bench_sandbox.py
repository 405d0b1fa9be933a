"""Benchmark: the cost of running a program in the sandbox vs the same interpreter unsandboxed.

Run: python scripts/bench_sandbox.py [--runs 20] [--program print]
Each run starts a fresh Python process for one small program (``print``: print(1); ``loop``: a
sum over 10^6 integers), once through ``staleflow.sandbox.run_python`` (bubblewrap, namespaces,
rlimits, the in-sandbox runner) and once as ``python3 -I -S`` with the same interpreter the sandbox
uses (the baseline), interleaved in the same run. ``--program tests`` measures the code-with-tests
harness instead (``sandbox.tests_run.run_tests``: a solution and 5 asserts, two processes in one
sandbox) against the pre-2026-12-07 way, the solution and its asserts as one sandboxed program. Times are wall-clock per run (a process start is
the thing measured), median and p90 over the runs. The last line is JSON with ``sandbox_ms``,
``baseline_ms`` and ``ratio`` (sandbox / baseline medians).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from staleflow.sandbox import SandboxLimits, run_python, sandbox_unavailable
from staleflow.sandbox.bwrap import interpreter

PROGRAMS = {
    "print": "print(1)\n",
    "loop": "print(sum(range(1_000_000)))\n",
    "tests": "def add(a, b):\n    return a + b\n",
}
TESTS = [f"assert add({i}, {i}) == {2 * i}" for i in range(5)]


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, Python {platform.python_version()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--program", choices=sorted(PROGRAMS), default="print")
    a = p.parse_args()
    if a.runs < 1:
        raise SystemExit("bench_sandbox: --runs must be >= 1")
    if (problem := sandbox_unavailable()) is not None:
        raise SystemExit(f"bench_sandbox: {problem}")
    code = PROGRAMS[a.program]
    limits = SandboxLimits()
    python = interpreter(limits)
    if a.program == "tests":
        return bench_tests(a.runs, code, limits)
    sandboxed, plain = [], []
    for _ in range(a.runs):
        r = run_python(code, limits)
        if r.reason is not None or r.exit_code != 0:
            raise SystemExit(
                f"bench_sandbox: the sandboxed program failed ({r.reason}, exit {r.exit_code}): {r.stderr[-200:]}"
            )
        sandboxed.append(r.wall_s)
        t0 = time.monotonic()
        subprocess.run([python, "-I", "-S", "-c", code], check=True, capture_output=True, env={})
        plain.append(time.monotonic() - t0)
    med_s, med_b = statistics.median(sandboxed), statistics.median(plain)
    p90 = lambda xs: sorted(xs)[max(0, int(round(0.9 * len(xs))) - 1)]  # noqa: E731
    print(f"hardware: {hardware()}")
    print(f"program {a.program!r}, {a.runs} runs each, interleaved")
    print(f"  sandbox  median {1e3 * med_s:7.1f} ms   p90 {1e3 * p90(sandboxed):7.1f} ms")
    print(f"  baseline median {1e3 * med_b:7.1f} ms   p90 {1e3 * p90(plain):7.1f} ms   ({python} -I -S)")
    out = {
        "program": a.program,
        "runs": a.runs,
        "sandbox_ms": round(1e3 * med_s, 2),
        "baseline_ms": round(1e3 * med_b, 2),
    }
    out["ratio"] = round(med_s / med_b, 3)
    print(json.dumps(out))


def bench_tests(runs: int, code: str, limits: SandboxLimits) -> None:
    from staleflow.sandbox.tests_run import run_tests, split_tests

    statements = split_tests(TESTS)
    harness, joined = [], []
    for _ in range(runs):
        r = run_tests(code, statements, limits)
        if not getattr(r, "ok", False):
            raise SystemExit(f"bench_sandbox: the harness failed: {r}")
        harness.append(r.wall_s)
        r = run_python(code + "\n" + "\n".join(TESTS) + "\n", limits)
        if not r.ok:
            raise SystemExit(f"bench_sandbox: the joined program failed ({r.reason}, exit {r.exit_code})")
        joined.append(r.wall_s)
    med_h, med_j = statistics.median(harness), statistics.median(joined)
    print(f"hardware: {hardware()}")
    print(f"program 'tests' (a solution + {len(TESTS)} asserts), {runs} runs each, interleaved")
    print(f"  harness (tests_run)    median {1e3 * med_h:7.1f} ms")
    print(f"  baseline (one program) median {1e3 * med_j:7.1f} ms")
    out = {"program": "tests", "runs": runs, "harness_ms": round(1e3 * med_h, 2), "baseline_ms": round(1e3 * med_j, 2)}
    out["ratio"] = round(med_h / med_j, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
