"""The code-with-tests harness, INSIDE the sandbox (never imported by staleflow; standard library only).

bwrap starts it with the sandbox's Python; it produces the verdict, out of the solution's reach:

    python3 -I -B /.staleflow/harness.py VERDICT_FD JOB_FD REASON_FD LIMITS

1. It reads the job (a per-run random nonce and the test statements) from JOB_FD, a memory file the
   host wrote, and closes it: the solution's process is started later and never holds it.
2. It makes itself non-dumpable (prctl PR_SET_DUMPABLE 0): no other process of the sandbox's user can
   open /proc/<harness>/fd/*, read its memory or ptrace it. Where that fails it reports an error and
   runs nothing.
3. It starts the SOLUTION in a fresh interpreter (runner.py serve: exec, not fork, so that process's
   memory holds neither the nonce nor the tests) with only two pipes and the label pipe: not
   VERDICT_FD. The solution runs as __main__, then offers its names; the harness never runs a line of
   it and never imports anything from /sandbox (its sys.path has no writable folder).
4. It runs each test statement in ITS OWN interpreter, where the solution's functions are proxies:
   a call crosses the pipe as plain data (wire.py) and the result comes back as plain data that the
   harness rebuilds with its own types. A name of the solution that is a builtin's (``abs``,
   ``isinstance``) is not offered: the tests call the real one. Patched builtins, assert machinery, sys.exit / os._exit,
   signals, atexit or __del__ in the solution's process change nothing here; an object with its own
   __eq__ cannot cross; a solution that exits or dies fails every test left.
5. Each test's result goes to VERDICT_FD as "NONCE I ok" or "NONCE I fail WHY", then "NONCE end N". The
   host credits the run only when all N tests report ok with its nonce; the exit status and
   anything printed are not read.
"""

import builtins
import json
import os
import signal
import subprocess
import sys

STALEFLOW = "/.staleflow"
RUNNER = f"{STALEFLOW}/runner.py"
sys.path.insert(0, STALEFLOW)  # wire.py and runner.py: ours, read-only

import runner  # noqa: E402
import wire  # noqa: E402


class SolutionError(Exception):
    """A solution's function raised something that is not a builtin exception, or its process ended."""


class Remote:
    """The pipe to the solution's process: calls its functions by handle."""

    def __init__(self, proc, requests: int, replies: int):
        self.proc, self.requests, self.replies = proc, requests, replies
        self.dead = ""

    def hello(self) -> dict:
        msg = self._recv()
        if not isinstance(msg, dict) or not isinstance(msg.get("names"), dict):
            died = msg.get("died") if isinstance(msg, dict) else None
            raise SolutionError(f"the solution stopped before its definitions were read ({str(died)[:200]})")
        return msg["names"]

    def _recv(self):
        try:
            return wire.recv(self.replies)
        except wire.WireError as e:
            self.dead = f"the solution's process sent a message that does not decode ({e})"
            raise SolutionError(self.dead) from None
        except (EOFError, OSError):
            try:
                status = self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                status = "still running"
            self.dead = f"the solution's process ended (exit status {status})"
            raise SolutionError(self.dead) from None

    def function(self, handle: int) -> wire.RemoteFunction:
        return wire.RemoteFunction(handle, self.call)

    def call(self, handle: int, args: tuple, kwargs: dict):
        if self.dead:
            raise SolutionError(self.dead)
        try:
            msg = {
                "fn": handle,
                "args": [wire.encode(a) for a in args],
                "kwargs": {str(k): wire.encode(v) for k, v in kwargs.items()},
            }
        except wire.WireError as e:
            raise SolutionError(f"an argument cannot be passed to the solution's process: {e}") from None
        try:
            wire.send(self.requests, msg)
        except OSError:
            self.dead = "the solution's process ended"
            raise SolutionError(self.dead) from None
        reply = self._recv()
        if not isinstance(reply, dict):
            raise SolutionError("the solution's process sent a malformed reply")
        if "raise" in reply:
            kind = getattr(builtins, str(reply["raise"]), None)
            message = str(reply.get("msg", ""))[:500]
            if isinstance(kind, type) and issubclass(kind, Exception):
                try:
                    error = kind(message)
                except Exception:
                    error = None
                if error is not None:
                    raise error
            raise SolutionError(f"the solution raised {str(reply['raise'])[:80]}: {message}")
        if "ok" not in reply:
            raise SolutionError(f"the solution's call {str(reply.get('unreadable', 'failed'))[:200]}")
        result = wire.decode(reply["ok"], self.function)
        for mine, theirs in zip(args, reply.get("args") or []):
            _apply_in_place(mine, theirs, self.function)
        return result


def _apply_in_place(mine, theirs, remote) -> None:
    """A list, dict, set or bytearray argument the solution changed in place: the same change here."""
    if theirs is None or type(mine) not in (list, dict, set, bytearray):
        return
    try:
        new = wire.decode(theirs, remote)
    except wire.WireError:
        return
    if type(new) is not type(mine):
        return
    if isinstance(mine, (list, bytearray)):
        mine[:] = new
    else:
        mine.clear()
        mine.update(new)


def _module(name: str):
    """A standard-library module the solution imported, imported here on its own (never from /sandbox)."""
    top = name.split(".")[0]
    if not all(p.isidentifier() for p in name.split(".")) or top not in sys.stdlib_module_names:
        return None
    import importlib

    try:
        return importlib.import_module(name)
    except Exception:
        return None


def set_private() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main() -> None:
    verdict_fd, job_fd, reason_fd = (int(a) for a in sys.argv[1:4])
    limits_json = sys.argv[4]
    with os.fdopen(job_fd, "rb") as f:
        job = json.loads(f.read())
    nonce, tests = job["nonce"], job["tests"]
    verdict = os.fdopen(verdict_fd, "w", buffering=1)

    def report(line: str) -> None:
        verdict.write(f"{nonce} {line}\n")

    try:
        set_private()
        runner.set_limits(json.loads(limits_json))
    except Exception as e:
        report(f"error {type(e).__name__}: {e}")
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # the solution shares our uid: its signals change no result
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", RUNNER, str(reason_fd), limits_json, "serve", str(req_r), str(rep_w)],
        pass_fds=(reason_fd, req_r, rep_w),
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )
    for fd in (req_r, rep_w, reason_fd):
        os.close(fd)
    remote = Remote(proc, req_w, rep_r)
    namespace = {"__name__": "__tests__", "__builtins__": builtins}
    try:
        for name, entry in remote.hello().items():
            if not isinstance(entry, dict) or not isinstance(name, str) or hasattr(builtins, name):
                continue  # a solution's `abs` or `isinstance` never replaces the one the tests call
            if "m" in entry:
                # Only under its own name (`import math`, `from math import sqrt`): an alias
                # (`from unittest.mock import MagicMock as is_prime`) would answer a test with the
                # standard library's object instead of the solution's code, so it is not offered.
                path, attr = str(entry["m"]), entry.get("a")
                module = _module(path)
                if module is None:
                    continue
                if attr is None and name in (path.split(".")[0], path.split(".")[-1]):
                    namespace[name] = module
                elif attr == name and name.isidentifier() and hasattr(module, name):
                    namespace[name] = getattr(module, name)
            elif "v" in entry:
                try:
                    namespace[str(name)] = wire.decode(entry["v"], remote.function)
                except wire.WireError:
                    continue
    except SolutionError as e:
        remote.dead = str(e)
    for i, source in enumerate(tests):
        try:
            if remote.dead:
                raise SolutionError(remote.dead)
            exec(compile(source, f"<test {i + 1}>", "exec"), namespace)
        except BaseException as e:  # a failing test, whatever it raised (SystemExit in a test too)
            what = " ".join(str(e).split())[:200]
            report(f"{i} fail {type(e).__name__}{': ' + what if what else ''}")
        else:
            report(f"{i} ok")
    report(f"end {len(tests)}")
    verdict.close()
    proc.kill()
    proc.wait()


if __name__ == "__main__":
    main()
