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
from dataclasses import dataclass
from pathlib import Path

from staleflow.sandbox.bwrap import NOBODY, RUNNER_PATH, bwrap_path, command, drop_to_nobody, missing_bwrap, python_home
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


@dataclass
class Launched:
    """What one sandbox run left: bwrap's exit code, the output, whether it timed out or passed the
    output limit, bwrap's JSON status and the text written on each side pipe."""

    returncode: int | None
    out: _Output
    timed_out: bool
    status: str
    side: dict[str, str]
    wall_s: float


def launch(
    limits: SandboxLimits,
    files: list[tuple[str, str, bytes]],
    entry: list[str],
    side: tuple[str, ...] = ("reason",),
    stdin: str = "",
    inherit: tuple[tuple[str, bytes], ...] = (),
) -> Launched | SandboxResult:
    """Run the sandbox: ``files`` are (bwrap option, path inside, bytes), each passed as a memfd;
    ``entry`` the script and its arguments, where an argument ``{name}`` is replaced by the number of
    the fd of the file placed at that basename (``{job.json}``) or of the write end of side pipe
    ``name`` (``{reason}``) or of an ``inherit`` memfd (name, bytes): passed as an open fd only, never
    placed in the sandbox's file tree. Returns a SandboxResult with reason "unavailable" when it cannot start."""
    t0 = time.monotonic()
    missing = missing_bwrap()
    if missing:
        return SandboxResult("", missing, None, "unavailable", 0.0)
    fds = {os.path.basename(path): _memfd(os.path.basename(path), data) for _, path, data in files}
    handed = {name: _memfd(name, data) for name, data in inherit}
    pipes = {name: os.pipe() for name in ("status", *side)}
    numbers = {**fds, **handed, **{name: w for name, (_, w) in pipes.items()}}
    argv = command(
        limits,
        [(option, fds[os.path.basename(path)], path) for option, path, _ in files],
        pipes["status"][1],
        [str(numbers[arg[1:-1]]) if arg[:1] == "{" and arg[1:-1] in numbers else arg for arg in entry],
    )
    user = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if drop_to_nobody() else {}
    passed = (*fds.values(), *handed.values(), *(w for _, w in pipes.values()))
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=passed,
            start_new_session=True,
            close_fds=True,
            env={"PATH": "/usr/bin:/bin"},  # bwrap's own pid 1 in the sandbox shows its environ: none of ours
            **user,
        )
    except OSError as e:
        for fd in (*passed, *(r for r, _ in pipes.values())):
            os.close(fd)
        return SandboxResult("", f"sandbox: cannot start bwrap: {e}", None, "unavailable", time.monotonic() - t0)
    for fd in passed:
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
    texts = {name: _read_all(r) for name, (r, _) in pipes.items()}
    status = texts.pop("status")
    return Launched(proc.returncode, out, timed_out, status, texts, time.monotonic() - t0)


def unavailable(run: Launched) -> SandboxResult | None:
    """The 'unavailable' result when bwrap itself, or the interpreter inside, could not start."""
    if '"child-pid"' not in run.status:  # bwrap itself failed: nothing of the code ran
        line = (run.out.text("stderr").strip().splitlines() or [f"bwrap exited {run.returncode}"])[0]
        return SandboxResult("", f"sandbox: bwrap could not start: {line}", None, "unavailable", run.wall_s)
    if run.returncode == 1 and run.out.text("stderr").startswith("bwrap: execvp"):  # no such interpreter inside
        line = run.out.text("stderr").strip().splitlines()[0]
        return SandboxResult(
            "",
            f"sandbox: cannot start the interpreter: {line}: check SandboxLimits.python",
            None,
            "unavailable",
            run.wall_s,
        )
    return None


def outcome(run: Launched) -> tuple[int | None, str | None]:
    """(exit code or None when killed, reason or None) of a finished sandbox run."""
    first_reason = run.side.get("reason", "").split("\n", 1)[0].strip()
    exit_code: int | None = run.returncode
    reason: str | None = None
    if run.timed_out:
        exit_code, reason = None, "timeout"
    elif run.out.over:
        exit_code, reason = None, "output-limit"
    elif exit_code is not None and exit_code > 128 and '"exit-code"' in run.status:  # bwrap: 128 + signal
        exit_code, reason = None, first_reason or SIGNAL_REASONS.get(exit_code - 128, "killed")
    elif exit_code is not None and exit_code < 0:  # bwrap itself killed
        exit_code, reason = None, "killed"
    if reason is None and first_reason:
        reason = first_reason
    return exit_code, reason


def runner_budget(limits: SandboxLimits) -> str:
    """The runner's argument: the limits it sets inside, and the extra folders it may read."""
    budget = {k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "processes", "file_mb")}
    budget["visible"] = [home] if (home := python_home(limits)) else []
    return json.dumps(budget)


def run_python(code: str, limits: SandboxLimits, stdin: str = "") -> SandboxResult:
    """Run `code` as /sandbox/main.py inside the sandbox; see the module docstring."""
    files = [
        ("--file", "/sandbox/main.py", code.encode("utf-8", errors="surrogateescape")),
        ("--ro-bind-data", RUNNER_PATH, RUNNER.read_bytes()),
    ]
    run = launch(limits, files, [RUNNER_PATH, "{reason}", runner_budget(limits)], stdin=stdin)
    if isinstance(run, SandboxResult):
        return run
    refused = unavailable(run)
    if refused is not None:
        return refused
    exit_code, reason = outcome(run)
    return SandboxResult(run.out.text("stdout"), run.out.text("stderr"), exit_code, reason, run.wall_s)


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
