"""Run a command the way a user would and report what it cost: its exit code, its stderr lines, and its
own peak memory (VmHWM, read by a small launcher from /proc just before the process is reaped, so the
pytest process's memory, which a fork would count, is not). Used by the bounded-reader tests (issue 50):
hostile input must end in one line and a non-zero exit within bounded time and under 1 GB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The launcher: a fresh small interpreter that starts the command, samples its VmHWM until it exits
# (a process's high-water mark, reset at exec), kills it past the limit, and prints the result as JSON.
LAUNCHER = r"""
import json, os, subprocess, sys, time
limit, argv = float(sys.argv[1]), sys.argv[2:]
p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
peak, t0, killed = 0, time.monotonic(), False
import threading
out = {}
def drain(name, stream):
    out[name] = stream.read()
threads = [threading.Thread(target=drain, args=(n, s)) for n, s in (("stdout", p.stdout), ("stderr", p.stderr))]
for t in threads:
    t.start()
while p.poll() is None:
    try:
        for line in open(f"/proc/{p.pid}/status"):
            if line.startswith("VmHWM:"):
                peak = max(peak, int(line.split()[1]) * 1024)
    except OSError:
        pass
    if time.monotonic() - t0 > limit:
        os.killpg(p.pid, 9)
        killed = True
    time.sleep(0.02)
for t in threads:
    t.join()
print(json.dumps({"code": None if killed else p.returncode, "peak": peak, "wall": time.monotonic() - t0,
                  "stderr": out["stderr"].decode(errors="replace"), "stdout": out["stdout"].decode(errors="replace")}))
"""


@dataclass
class Outcome:
    code: int | None
    """The exit code; None when it was killed at the time limit (a hang)."""
    peak_bytes: int
    wall_s: float
    stderr: str
    stdout: str

    @property
    def lines(self) -> list[str]:
        return [x for x in self.stderr.splitlines() if x.strip()]


def run_bounded(argv: list[str], cwd: Path | None = None, limit_s: float = 120.0, env: dict | None = None) -> Outcome:
    res = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(limit_s), *argv],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        env=env or dict(os.environ),
        timeout=limit_s + 60,
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return Outcome(got["code"], got["peak"], got["wall"], got["stderr"], got["stdout"])


def staleflow(*args: str, cwd: Path | None = None, limit_s: float = 120.0) -> Outcome:
    """``python -m staleflow ARGS`` bounded (a hang is killed at limit_s and reported as code None)."""
    return run_bounded([sys.executable, "-m", "staleflow", *args], cwd=cwd, limit_s=limit_s)


GB = 1 << 30
