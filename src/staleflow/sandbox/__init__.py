"""staleflow.sandbox: run untrusted, model-written Python in bubblewrap with limits.

    from staleflow.sandbox import SandboxLimits, run_python, sandbox_unavailable

    if (problem := sandbox_unavailable()) is not None:
        raise SystemExit(problem)                    # one line: why, and the fix
    r = run_python(code, SandboxLimits(wall_s=5, cpu_s=2, memory_mb=256), stdin="")
    r.stdout, r.stderr, r.exit_code, r.reason, r.wall_s

No network, one private writable tmpfs (/sandbox), the system's /usr read-only and nothing else of
the host (no /work, no home, no /tmp, no run folder, an empty environment); CPU-time, memory,
process-count, file-size and output limits and a wall-clock timeout. docs/sandbox.md has the
choice of bubblewrap, the limits and what the sandbox does NOT protect against.
"""

from staleflow.sandbox.limits import REASONS, SandboxLimits, SandboxResult
from staleflow.sandbox.run import run_python, sandbox_unavailable

__all__ = ["REASONS", "SandboxLimits", "SandboxResult", "run_python", "sandbox_unavailable"]
