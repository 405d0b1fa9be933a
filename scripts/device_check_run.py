"""Run one step of scripts/device_check.sh under its limit, and leave nothing of it behind.

    python scripts/device_check_run.py --limit 60 --log step.log -- CMD [ARGS...]

``timeout`` kills only its own process group, but torchrun starts its workers in new sessions
(``start_new_session=True``), so a timed-out step could leave ranks holding the GPU and /dev/shm
through the following steps. Here:
1. the step runs in a session of its own with a marker in its environment
   (``STALEFLOW_DEVCHECK_STEP=<random id>``), which every process it starts inherits, whatever
   session or process group that process later moves to (setsid, start_new_session);
2. when the step ends, or at its limit, every live process that carries the marker, descends from
   the step, or sits in a session the step's processes opened is sent SIGTERM, then, after a short
   grace, SIGKILL, until none is left (each found by /proc, never by name);
3. with ``nvidia-smi`` on PATH it then waits (up to --gpu-wait seconds) until no compute process
   holds the GPU and records whether it is free; without one that check is skipped.
The command's output goes to --log; the exit status is the command's, 124 after the limit. The
last line on stdout is JSON: ``{"rc", "seconds", "timed_out", "killed", "left", "gpu_free"}``.
The step also gets ``STALEFLOW_DEVCHECK_DEADLINE`` (a ``time.time()`` value, a few seconds before its
limit): a step that waits on its own children (device_check_steps.py) stops waiting there and reports
what it saw (a child's exit code) instead of being killed as a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

MARKER = "STALEFLOW_DEVCHECK_STEP"
DEADLINE = "STALEFLOW_DEVCHECK_DEADLINE"
REPORT_S = 5.0
"""Seconds before its limit at which a step's own waits end, to report before it is killed."""


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a live process, None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[3])


def _has_marker(pid: int, token: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return token in f.read().split(b"\0")
    except OSError:
        return False


def step_processes(root: int, marker: str, sessions: set[int]) -> set[int]:
    """Live processes of the step: carrying ``MARKER=marker``, descending from ``root``, or in one of
    ``sessions`` (which grows with the sessions found, so a setsid child's own children count too)."""
    token = f"{MARKER}={marker}".encode()
    me = os.getpid()
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            st = _proc_stat(int(name))
            if st is not None:
                stats[int(name)] = st
    # never this driver's own session or ancestors (a reused pid must not widen the kill to them)
    mine, ancestors, p = os.getsid(0), set(), os.getppid()
    while p > 1 and p not in ancestors:
        ancestors.add(p)
        p = stats.get(p, (0, 0))[0]
    stats = {pid: st for pid, st in stats.items() if pid not in ancestors}
    found = {pid for pid in stats if pid == root or _has_marker(pid, token)}
    changed = True
    while changed:  # close over children and sessions
        sessions |= {stats[p][1] for p in found if stats[p][1] not in (0, 1, mine)}
        more = {p for p, (ppid, sid) in stats.items() if p not in found and (ppid in found or sid in sessions)}
        changed = bool(more)
        found |= more
    return found


def kill_step(root: int, marker: str, grace_s: float = 3.0) -> tuple[int, int]:
    """SIGTERM then SIGKILL every process of the step until none is left; (killed, still alive)."""
    sessions: set[int] = set()
    killed: set[int] = set()
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    for _ in range(200):
        procs = step_processes(root, marker, sessions)
        if not procs:
            return len(killed), 0
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        for pid in procs:
            try:
                os.kill(pid, sig)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return len(killed), len(step_processes(root, marker, sessions))


def gpu_free(wait_s: float) -> bool | None:
    """True once nvidia-smi lists no compute process (within wait_s), False if one stays; None
    without nvidia-smi (a CPU machine: nothing to check)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            out = subprocess.run(
                [smi, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode != 0:  # no NVML here (a sandbox): nothing to check, not "busy" for gpu_wait
            return None
        if not out.stdout.strip():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def run_step(cmd: list[str], limit_s: float, log: str, grace_s: float = 3.0, gpu_wait_s: float = 15.0) -> dict:
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, DEADLINE: f"{time.time() + max(limit_s - REPORT_S, limit_s / 2):.3f}"}
    t0 = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = 124, True
    # after a normal end too (orphans it left); the root only while unreaped (its pid cannot be reused yet)
    killed, left = kill_step(proc.pid if timed_out else 0, marker, grace_s)
    proc.wait()
    if timed_out:
        with open(log, "a") as out:
            out.write(f"\ndevice_check: the step ran past its limit of {limit_s:g} s and was killed\n")
    return {
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 1),
        "timed_out": timed_out,
        "killed": killed,
        "left": left,
        "gpu_free": gpu_free(gpu_wait_s),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, required=True, help="seconds")
    ap.add_argument("--log", required=True)
    ap.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--gpu-wait", type=float, default=15.0, help="seconds to wait for the GPU to be free")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("device_check_run: no command given after --", file=sys.stderr)
        return 2
    res = run_step(cmd, args.limit, args.log, args.grace, args.gpu_wait)
    print(json.dumps(res), flush=True)
    return res["rc"] if res["left"] == 0 else 125


if __name__ == "__main__":
    sys.exit(main())
