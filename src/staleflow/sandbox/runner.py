"""The program that starts the untrusted code INSIDE the sandbox (never imported by staleflow).

bwrap copies this file into the sandbox (read-only) and runs it with the sandbox's Python:

    python3 -I -B /.staleflow/runner.py REASON_FD '{"cpu_s": 5, "memory_mb": 512, ...}'
    python3 -I -B /.staleflow/runner.py REASON_FD LIMITS serve REQUEST_FD REPLY_FD   # started by harness.py

It sets the resource limits (they cannot be raised again: raising a hard limit needs
CAP_SYS_RESOURCE in the host's user namespace), then runs /sandbox/main.py as __main__ (compiled and executed in a fresh __main__ module). It only
LABELS what the kernel-level walls refuse, so that SandboxResult.reason says why a run failed: an
audit hook notes the first attempt to reach the network or a path outside the visible folders, and
an excepthook maps an uncaught MemoryError / EAGAIN / ENETUNREACH / EROFS ... to a reason. Each
reason is one line written to REASON_FD; the parent keeps the first. The code can forge or
suppress these labels, never lift the walls: enforcement is bwrap's namespaces and the rlimits.
In serve mode (the code-with-tests reward, harness.py) the program's names are then offered to the
harness and its calls answered as plain data (wire.py); the verdict is the harness's, not ours.
Standard library only: nothing of the project is visible in here.
"""

import errno
import json
import os
import resource
import socket
import sys
import types

FOLDER = "/sandbox"
STALEFLOW = "/.staleflow"
VISIBLE = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/dev", "/proc", FOLDER, "/.staleflow")
WRITABLE_DEVICES = ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "/dev/zero", "/dev/full")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "", None)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
WRITE_EVENTS = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink", "os.link")

_noted = False
_reason_fd = -1


def note(reason: str) -> None:
    """Write the reason line once per process (the parent keeps the first line of all processes)."""
    global _noted
    if _noted:
        return
    _noted = True
    try:
        os.write(_reason_fd, (reason + "\n").encode())
    except OSError:
        pass  # the program closed the fd: the label is lost, the walls are not


def _path(value) -> str | None:
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    if not isinstance(value, str):
        return None  # a file descriptor
    return os.path.normpath(os.path.join(os.getcwd(), value))


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _is_write(mode, flags) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and flags >= 0 and bool(flags & WRITE_FLAGS)


def audit(event: str, args: tuple) -> None:
    """Note (never block) an attempt that the sandbox's walls refuse."""
    if event == "open":
        path = _path(args[0])
        if path is None:
            return
        if _is_write(args[1], args[2] if len(args) > 2 else -1):
            if not _under(path, (FOLDER,)) and path not in WRITABLE_DEVICES and not path.startswith("/proc/self/fd/"):
                note("filesystem")
        elif not _under(path, VISIBLE):
            note("filesystem")
    elif event in WRITE_EVENTS:
        path = _path(args[0])
        if path is not None and not _under(path, (FOLDER,)):
            note("filesystem")
    elif event in ("os.listdir", "os.scandir"):
        path = _path(args[0]) if args and args[0] is not None else None
        if path is not None and path != "/" and not _under(path, VISIBLE):
            note("filesystem")
    elif event in ("socket.connect", "socket.sendto"):
        address = args[1]
        if isinstance(address, tuple) and address and address[0] not in LOCAL_HOSTS:
            note("network")
        elif isinstance(address, (str, bytes)) and address[:1] in ("\0", b"\0"):
            note("network")  # an abstract unix socket: the host's live in another network namespace
    elif event == "socket.getaddrinfo" and args[0] not in LOCAL_HOSTS:
        note("network")


def reason_of(exc: BaseException) -> str | None:
    """The reason an uncaught exception stands for (None: the program's own error)."""
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return "processes"
    if isinstance(exc, socket.gaierror):
        return "network"
    if not isinstance(exc, OSError):
        return None
    if exc.errno == errno.EAGAIN:
        return "processes"
    if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN):
        return "network"
    if exc.errno == errno.EFBIG:
        return "file-size"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "folder-full"
    paths = [_path(p) for p in (exc.filename, exc.filename2) if p is not None]
    if exc.errno == errno.EROFS or any(p is not None and not _under(p, (FOLDER,)) for p in paths):
        return "filesystem"
    return None


def excepthook(kind, value, tb) -> None:
    reason = reason_of(value)
    if reason:
        note(reason)
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # the traceback starts at the program's own code
    sys.__excepthook__(kind, value.with_traceback(tb), tb)


def set_limits(limits: dict) -> None:
    mb = 1 << 20
    for limit, soft, hard in (
        (resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1),  # SIGXCPU first, SIGKILL a second later
        (resource.RLIMIT_AS, limits["memory_mb"] * mb, limits["memory_mb"] * mb),
        (resource.RLIMIT_NPROC, limits["processes"], limits["processes"]),
        (resource.RLIMIT_FSIZE, limits["file_mb"] * mb, limits["file_mb"] * mb),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(limit, (soft, hard))


def main() -> None:
    global _reason_fd, VISIBLE
    _reason_fd = int(sys.argv[1])
    limits = json.loads(sys.argv[2])
    serve_fds = [int(fd) for fd in sys.argv[4:6]] if sys.argv[3:4] == ["serve"] else None
    VISIBLE = VISIBLE + tuple(limits["visible"])
    set_limits(limits)
    sys.argv = [FOLDER + "/main.py"]
    sys.path[0] = FOLDER
    sys.excepthook = excepthook
    sys.addaudithook(audit)
    main_module = types.ModuleType("__main__")
    main_module.__file__ = sys.argv[0]
    sys.modules["__main__"] = main_module
    with open(sys.argv[0], "rb") as f:
        code = compile(f.read(), sys.argv[0], "exec")
    if serve_fds is None:
        exec(code, main_module.__dict__)
        return
    sys.path.insert(1, STALEFLOW)  # wire.py (read-only, ours) after the program's own folder
    import wire

    try:
        exec(code, main_module.__dict__)
    except SystemExit:
        pass  # the program ended early, as a script may: its definitions stand and are tested
    except BaseException as e:  # the harness reads that the definitions never came (no verdict from here)
        wire.send(serve_fds[1], {"died": f"{type(e).__name__}: {str(e)[:300]}"})
        raise
    serve(main_module.__dict__, *serve_fds, wire)


def serve(namespace: dict, requests: int, replies: int, wire) -> None:
    """Code-with-tests mode: offer the program's names to the harness, then answer its calls. What
    crosses is plain data (wire.py); nothing here decides whether a test passed (harness.py)."""
    handles: dict = {}
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            names[name] = {"m": value.__name__}
            continue
        home = getattr(value, "__module__", None) if callable(value) else None
        if isinstance(home, str) and home.split(".")[0] in sys.stdlib_module_names:
            names[name] = {"m": home, "a": getattr(value, "__name__", name)}  # `from math import sqrt`
            continue
        try:
            names[name] = {"v": wire.encode(value, handles)}
        except (wire.WireError, RecursionError):
            continue  # not plain data: not offered (a test naming it reads a NameError)
    wire.send(replies, {"names": names})
    while True:
        try:
            msg = wire.recv(requests)
        except EOFError:
            return
        wire.send(replies, answer(msg, handles, wire))


def answer(msg, handles: dict, wire) -> dict:
    """One call: {"fn": handle, "args": [...], "kwargs": {...}} -> {"ok": result, "args": [...]} or {"raise": ...}."""
    try:
        fn = handles[msg["fn"]]
        args = [wire.decode(a, handles.__getitem__) for a in msg["args"]]
        kwargs = {k: wire.decode(v, handles.__getitem__) for k, v in msg["kwargs"].items()}
        result = fn(*args, **kwargs)
    except BaseException as e:  # SystemExit and the like too: the harness reads them as a failure
        return {"raise": type(e).__name__, "msg": str(e)[:500]}
    try:
        out = {"ok": wire.encode(result, handles)}
    except (wire.WireError, RecursionError) as e:
        return {
            "unreadable": f"returned {e}" if isinstance(e, wire.WireError) else "returned a value nested too deeply"
        }
    after = []
    for a in args:  # the arguments after the call: the harness applies in-place changes to its own
        try:
            after.append(wire.encode(a, handles))
        except (wire.WireError, RecursionError):
            after.append(None)
    out["args"] = after
    return out


if __name__ == "__main__":
    main()
