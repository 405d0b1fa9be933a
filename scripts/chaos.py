"""Chaos runs: start the real system (launch.sh, tiny model) K times, kill a random process kind
at a random step of each run, and audit what the run left behind.

    python scripts/chaos.py --runs 10 [--steps 12] [--seed 0]

Each run trains --steps versions with --checkpoint.every 3 and elastic restarts; after a random
step (1 .. steps-2) it SIGKILLs the controller, the trainer rank or a rollout rank (chosen at
random). Counted per run: ``lost`` (a buffer missing or not trained with all its groups, or the
run did not finish with exit 0), ``duplicated`` (a buffer or a trajectory trained twice, or an id
reused), ``hangs`` (no exit within --timeout), ``leaks`` (a staleflow process or /dev/shm segment
of the run left). Prints one line per run and, last, one JSON line with the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VICTIMS = ("staleflow[controller]", "staleflow[trainer 0]", "staleflow[rollout 0]", "staleflow[rollout 1]")


def tagged(tag: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"STALEFLOW_CHAOS_TAG={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
                if state != "Z":
                    out.append(int(pid))
        except OSError:
            continue
    return out


def titled(tag: str, title: str) -> list[int]:
    found = []
    for pid in tagged(tag):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip().startswith(title.encode()):
                found.append(pid)
        except OSError:
            continue
    return found


def last_step(run: Path) -> int:
    try:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return -1
    return max((r["step"] for r in rows), default=-1)


def one_run(i: int, args, rng: random.Random, root: Path) -> dict:
    from staleflow.metrics.audit import audit_run

    tag, name = uuid.uuid4().hex, f"chaos-{i}"
    shm_before = set(os.listdir("/dev/shm"))
    victim, at = rng.choice(VICTIMS), rng.randint(1, args.steps - 2)
    env = dict(
        os.environ,
        STALEFLOW_CHAOS_TAG=tag,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p),
    )
    cmd = [
        "bash",
        str(ROOT / "launch.sh"),
        "--preset",
        "tiny",
        "--steps",
        str(args.steps),
        "--checkpoint.every",
        "3",
        "--log.run-dir",
        str(root),
        "--log.name",
        name,
        "--log.no-progress",
        "--log.no-plot",
        "--reward.fn",
        "e2e_rewards:text_length",
        "--seed",
        str(rng.randint(0, 10_000)),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True, cwd=ROOT
    )
    killed, hang = False, False
    ours: set[int] = set()  # every pid of this run, to attribute shared-memory segments to it
    deadline = time.monotonic() + args.timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            ours.update(tagged(tag))
            if not killed and last_step(root / name) >= at:
                pids = titled(tag, victim)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed = True
            time.sleep(0.1)
        if proc.poll() is None:
            hang = True
        out = proc.communicate(timeout=5)[0] if not hang else ""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    gone_by = time.monotonic() + 20  # processes of the last attempt may take a moment to exit
    while tagged(tag) and time.monotonic() < gone_by:
        time.sleep(0.2)
    report = audit_run(root / name, args.steps, batch_size=4, group_size=4, eta=1)
    dup = [p for p in report.problems if "twice" in p or "reused" in p]
    lost = [p for p in report.problems if p not in dup] + (
        [] if proc.returncode == 0 or hang else [f"exit {proc.returncode}"]
    )
    left = tagged(tag)
    left_titles = []
    for pid in left:
        try:
            left_titles.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()[:60].decode())
        except OSError:
            pass
        os.kill(pid, signal.SIGKILL)
    from staleflow.servers.segment import list_segments, segment_owner

    shm_left = {n for n in list_segments() if n not in shm_before and (segment_owner(n) or (0,))[0] in ours}
    row = {
        "run": i,
        "victim": victim,
        "after_step": at,
        "killed": killed,
        "exit": proc.returncode,
        "lost": bool(lost) and not hang,
        "duplicated": bool(dup),
        "hang": hang,
        "leak": bool(left or shm_left),
        "problems": (lost + dup)[:3]
        + ([f"left running: {left_titles}"] if left else [])
        + ([f"left in /dev/shm: {sorted(shm_left)}"] if shm_left else []),
    }
    if (lost or dup) and not hang:
        row["tail"] = out[-1500:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as hung")
    args = ap.parse_args()
    if args.steps < 4:
        raise SystemExit("--steps must be >= 4 (a fault lands between step 1 and steps-2)")
    rng = random.Random(args.seed)
    counts = {"runs": 0, "lost": 0, "duplicated": 0, "hangs": 0, "leaks": 0}
    with tempfile.TemporaryDirectory(prefix="staleflow-chaos-") as root:
        for i in range(args.runs):
            t0 = time.monotonic()
            row = one_run(i, args, rng, Path(root))
            counts["runs"] += 1
            counts["lost"] += row["lost"]
            counts["duplicated"] += row["duplicated"]
            counts["hangs"] += row["hang"]
            counts["leaks"] += row["leak"]
            print(
                f"run {i}: kill {row['victim']} after step {row['after_step']} (killed={row['killed']}): "
                f"exit {row['exit']}, {time.monotonic() - t0:.0f} s"
                + (f", PROBLEMS {row['problems']}" if row["problems"] else ""),
                flush=True,
            )
            if "tail" in row:
                print(row["tail"], file=sys.stderr)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
