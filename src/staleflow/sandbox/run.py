"""run_python: run untrusted Python in the bubblewrap sandbox, with limits, and say why it stopped.

    from staleflow.sandbox import SandboxLimits, run_python

    r = run_python("print(sum(range(10)))", SandboxLimits(wall_s=5))
    r.stdout == "45\\n", r.exit_code == 0, r.reason is None

Synchronous (callers that must not block run it in a thread). Never raises for anything the code
does: a limit, a refused access or a crash comes back as SandboxResult.reason; a sandbox that cannot
start comes back as reason "unavailable" with the one-line cause in stderr, and nothing ran.
Steps: the code and the runner go to bwrap as in-memory files (memfd), bwrap starts the runner in
fresh namespaces (as uid 65534 when we are root), two threads read stdout/stderr up to the output
limit, and past the wall-clock limit or the output limit the whole process group is killed (bwrap's
PID namespace takes every process of the sandbox with it).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from staleflow.sandbox.bwrap import NOBODY, bwrap_path, command, drop_to_nobody, missing_bwrap, python_home
from staleflow.sandbox.limits import SandboxLimits, SandboxResult

RUNNER = Path(__file__).with_name("runner.py")
SIGNAL_REASONS = {signal.SIGXCPU: "cpu-time", signal.SIGXFSZ: "file-size"}
CHUNK = 65536


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)  # not inheritable: pass_fds makes it so for bwrap alone
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Output:
    """stdout and stderr read concurrently into one byte budget; past it, `over` is set and the
    sandbox killed."""

    def __init__(self, budget: int, kill) -> None:
        self.budget, self.kill = budget, kill
        self.parts: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.over = False
        self.lock = threading.Lock()

    def read(self, name: str, stream) -> None:
        while chunk := stream.read1(CHUNK) if hasattr(stream, "read1") else stream.read(CHUNK):
            with self.lock:
                room = self.budget - len(self.parts["stdout"]) - len(self.parts["stderr"])
                self.parts[name] += chunk[: max(room, 0)]
                if len(chunk) > room and not self.over:
                    self.over = True
                    self.kill()

    def text(self, name: str) -> str:
        return bytes(self.parts[name]).decode("utf-8", errors="replace")


def run_python(code: str, limits: SandboxLimits, stdin: str = "") -> SandboxResult:
    """Run `code` as /sandbox/main.py inside the sandbox; see the module docstring."""
    t0 = time.monotonic()
    missing = missing_bwrap()
    if missing:
        return SandboxResult("", missing, None, "unavailable", 0.0)
    code_fd = _memfd("main.py", code.encode("utf-8", errors="surrogateescape"))
    runner_fd = _memfd("runner.py", RUNNER.read_bytes())
    status_r, status_w = os.pipe()
    reason_r, reason_w = os.pipe()
    budget = {k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "processes", "file_mb")}
    budget["visible"] = [home] if (home := python_home(limits)) else []
    argv = command(limits, code_fd, runner_fd, status_w, reason_w, json.dumps(budget))
    user = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if drop_to_nobody() else {}
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(code_fd, runner_fd, status_w, reason_w),
            start_new_session=True,
            close_fds=True,
            env={"PATH": "/usr/bin:/bin"},  # bwrap's own pid 1 in the sandbox shows its environ: none of ours
            **user,
        )
    except OSError as e:
        for fd in (code_fd, runner_fd, status_r, status_w, reason_r, reason_w):
            os.close(fd)
        return SandboxResult("", f"sandbox: cannot start bwrap: {e}", None, "unavailable", time.monotonic() - t0)
    for fd in (code_fd, runner_fd, status_w, reason_w):
        os.close(fd)

    def kill() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    out = _Output(limits.output_bytes, kill)
    readers = [
        threading.Thread(target=out.read, args=(name, stream), daemon=True)
        for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))
    ]
    readers.append(threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True))
    for t in readers:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill()
        proc.wait()
    for t in readers:
        t.join(timeout=5.0)
    status, first_reason = _read_all(status_r), _read_all(reason_r).split("\n", 1)[0].strip()
    wall = time.monotonic() - t0
    if '"child-pid"' not in status:  # bwrap itself failed: nothing of the code ran
        line = (out.text("stderr").strip().splitlines() or [f"bwrap exited {proc.returncode}"])[0]
        return SandboxResult("", f"sandbox: bwrap could not start: {line}", None, "unavailable", wall)
    if proc.returncode == 1 and out.text("stderr").startswith("bwrap: execvp"):  # no such interpreter inside
        line = out.text("stderr").strip().splitlines()[0]
        return SandboxResult(
            "", f"sandbox: cannot start the interpreter: {line}: check SandboxLimits.python", None, "unavailable", wall
        )
    exit_code: int | None = proc.returncode
    reason: str | None = None
    if timed_out:
        exit_code, reason = None, "timeout"
    elif out.over:
        exit_code, reason = None, "output-limit"
    elif exit_code is not None and exit_code > 128 and '"exit-code"' in status:  # bwrap: 128 + signal
        exit_code, reason = None, first_reason or SIGNAL_REASONS.get(exit_code - 128, "killed")
    elif exit_code is not None and exit_code < 0:  # bwrap itself killed
        exit_code, reason = None, "killed"
    if reason is None and first_reason:
        reason = first_reason
    return SandboxResult(out.text("stdout"), out.text("stderr"), exit_code, reason, wall)


def sandbox_unavailable() -> str | None:
    """None when the sandbox can start here; else one line: why not and the fix. Untrusted code is
    never run without it: run_python then returns reason "unavailable" and runs nothing. The first
    call per bwrap binary starts one sandbox (~0.1 s) to find out."""
    return missing_bwrap() or _probe(bwrap_path() or "", os.geteuid())


@functools.cache
def _probe(path: str, uid: int) -> str | None:
    result = run_python("print('ok')", SandboxLimits(wall_s=30, cpu_s=10))
    if result.ok and result.stdout == "ok\n":
        return None
    first = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}, reason {result.reason}"])[0]
    first = first.removeprefix("sandbox: ")[:200]
    return (
        f"sandbox: bubblewrap ({path}) cannot start a sandbox here ({first}): it needs unprivileged user "
        f"namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; in a container, "
        f"allow them) and, as root, a bwrap that uid {NOBODY} can run; untrusted code is not run unsandboxed"
    )


def _feed(pipe, text: str) -> None:
    try:
        if text:
            pipe.write(text.encode("utf-8", errors="surrogateescape"))
        pipe.close()
    except (BrokenPipeError, OSError):
        pass  # the program exited or closed stdin without reading it all


def _read_all(fd: int) -> str:
    """What the sandbox wrote on a side pipe (all writers are gone once it exited)."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, CHUNK):
            chunks.append(chunk)
            if sum(map(len, chunks)) > CHUNK:
                break
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")
