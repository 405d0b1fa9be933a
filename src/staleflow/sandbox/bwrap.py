"""bubblewrap (bwrap): finding it, checking that it can start here, and its command line.

The sandbox is bubblewrap, Debian/Ubuntu's `bubblewrap` package (what Flatpak runs its apps in):
new user, mount, PID, network, IPC, UTS and cgroup namespaces; a root holding only the system's
/usr (read-only), a fresh /proc and a minimal /dev (read-only), and one private writable tmpfs,
/sandbox. Nothing else of the host exists inside: not /work, /home, /root, /tmp, /etc or the run
folder. The environment is cleared. See docs/sandbox.md for the choice and what it does not cover.

    argv = command(limits, [("--file", code_fd, "/sandbox/main.py"), ("--ro-bind-data", fd, RUNNER_PATH)],
                   status_fd, [RUNNER_PATH, str(reason_fd), runner_args])
"""

from __future__ import annotations

import os
import shutil
import sys

from staleflow.sandbox.limits import SandboxLimits

BWRAP_ENV = "STALEFLOW_BWRAP"
"""Path of the bwrap binary to use (default: `bwrap` on PATH)."""
NOBODY = 65534
"""As root, the sandbox runs as this uid/gid: the kernel never applies RLIMIT_NPROC to uid 0."""
STALEFLOW_DIR = "/.staleflow"
"""Where our own scripts (runner.py, harness.py, wire.py) are placed, read-only, inside the sandbox."""
RUNNER_PATH = f"{STALEFLOW_DIR}/runner.py"
INSTALL_HINT = "install bubblewrap (apt-get install bubblewrap; scripts/setup_env.sh does it when it can)"


def bwrap_path() -> str | None:
    """The bwrap binary: $STALEFLOW_BWRAP if set (a path), else `bwrap` on PATH; None if missing."""
    chosen = os.environ.get(BWRAP_ENV)
    if chosen:
        return chosen if os.path.isfile(chosen) and os.access(chosen, os.X_OK) else None
    return shutil.which("bwrap")


def interpreter(limits: SandboxLimits) -> str:
    """The Python run inside: limits.python, else /usr/bin/python3, else this Python's base interpreter."""
    if limits.python:
        return limits.python
    if os.path.isfile("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def python_home(limits: SandboxLimits) -> str | None:
    """The install tree of a Python outside /usr (bound read-only: the interpreter and its stdlib), else None."""
    real = os.path.realpath(interpreter(limits))
    return None if real.startswith("/usr/") else os.path.dirname(os.path.dirname(real))


def drop_to_nobody() -> bool:
    """Whether the sandbox must drop root (it then runs as NOBODY)."""
    return os.geteuid() == 0


def command(limits: SandboxLimits, files: list[tuple[str, int, str]], status_fd: int, entry: list[str]) -> list[str]:
    """The bwrap command line: ``files`` are (bwrap option, fd, path inside) to put in the sandbox
    (``--file`` for the writable program, ``--ro-bind-data`` for our own scripts), ``entry`` the
    script under /.staleflow and its arguments, run by the sandbox's Python (-I -B)."""
    python = interpreter(limits)
    binds = ["--ro-bind", "/usr", "/usr"]
    home = python_home(limits)
    if home:
        binds += ["--ro-bind", home, home]
    for link in ("bin", "sbin", "lib", "lib64"):
        if os.path.islink(f"/{link}"):
            binds += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        elif os.path.isdir(f"/{link}"):
            binds += ["--ro-bind", f"/{link}", f"/{link}"]
    placed = [arg for option, fd, path in files for arg in (option, str(fd), path)]
    return [
        bwrap_path() or "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv", "PATH", "/usr/bin:/bin",
        "--setenv", "HOME", "/sandbox",
        "--setenv", "TMPDIR", "/sandbox",
        "--setenv", "LANG", "C.UTF-8",
        "--hostname", "sandbox",
        *binds,
        "--proc", "/proc",
        "--dev", "/dev",
        "--remount-ro", "/dev",
        "--size", str(limits.folder_mb << 20), "--tmpfs", "/sandbox",
        *placed,
        "--remount-ro", "/",
        "--chdir", "/sandbox",
        "--json-status-fd", str(status_fd),
        python, "-I", "-B", *entry,
    ]  # fmt: skip


def missing_bwrap() -> str | None:
    """One line when there is no bwrap to run here (missing binary, not Linux), else None."""
    path = bwrap_path()
    if path is None:
        chosen = os.environ.get(BWRAP_ENV)
        where = f"{chosen!r} ({BWRAP_ENV}) is missing or not executable" if chosen else "bwrap is not on PATH"
        return f"sandbox: bubblewrap not found: {where}: {INSTALL_HINT}; untrusted code is not run unsandboxed"
    if sys.platform != "linux":
        return f"sandbox: bubblewrap needs Linux namespaces; this is {sys.platform}: run untrusted code on Linux"
    return None
