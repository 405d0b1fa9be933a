"""What a sandboxed run may use (SandboxLimits) and what came of it (SandboxResult).

    limits = SandboxLimits(wall_s=5, cpu_s=2, memory_mb=256)
    result = run_python("print(1 + 1)", limits)
    result.stdout == "2\\n" and result.reason is None

``reason`` is None when the program ran to completion without touching a limit or a wall; else one
short phrase (REASONS lists them), whatever the program's exit code.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONS = {
    "timeout": "the wall-clock limit passed; the whole sandbox was killed",
    "cpu-time": "the CPU-time limit (RLIMIT_CPU) was reached",
    "memory": "an allocation failed under the memory limit (RLIMIT_AS)",
    "processes": "a fork/thread failed under the process-count limit (RLIMIT_NPROC)",
    "output-limit": "stdout + stderr passed output_bytes; the whole sandbox was killed",
    "network": "the program tried to reach the network (there is none: own network namespace)",
    "filesystem": "the program tried to read or write outside its folder (not visible, or read-only)",
    "file-size": "a file grew past file_mb (RLIMIT_FSIZE)",
    "folder-full": "the private folder (a tmpfs of folder_mb) is full",
    "killed": "the program died of a signal",
    "unavailable": "the sandbox could not start: nothing ran (stderr says why)",
}
"""Every SandboxResult.reason, with its meaning (docs/sandbox.md)."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits of one sandboxed run. Small by default: a test suite of a few asserts needs far less.

    wall_s: wall-clock timeout (the whole sandbox is killed); cpu_s: CPU seconds per process;
    memory_mb: address space per process; processes: processes and threads at once in the sandbox;
    output_bytes: stdout + stderr kept, past which the run is killed; file_mb: largest file;
    folder_mb: size of the private folder (a tmpfs); python: the interpreter inside ("" = the
    system's /usr/bin/python3, else the base interpreter of this Python).
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    processes: int = 16
    output_bytes: int = 64_000
    file_mb: int = 8
    folder_mb: int = 32
    python: str = ""

    def __post_init__(self) -> None:
        for name, low in (("wall_s", 0), ("cpu_s", 0), ("memory_mb", 32), ("processes", 0), ("output_bytes", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low:
                raise ValueError(f"SandboxLimits.{name}={value!r}: must be a number > {low}")
        for name in ("cpu_s", "memory_mb", "processes", "output_bytes", "file_mb", "folder_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxLimits.{name}={value!r}: must be an integer >= 1")


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """The outcome of one run: its output (decoded as UTF-8, bad bytes replaced, cut at the output
    limit), its exit code (None when it was killed: by the sandbox's timeout or output limit, or by a
    signal), why it stopped early or was refused something (None: ran to completion untouched), and
    its wall time."""

    stdout: str
    stderr: str
    exit_code: int | None
    reason: str | None
    wall_s: float

    @property
    def ok(self) -> bool:
        """Exited 0 and touched no limit or wall."""
        return self.exit_code == 0 and self.reason is None
