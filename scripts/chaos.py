"""Chaos runs: start the real system (launch.sh, tiny model) once per run, inject one fault of a
kind taken round-robin from KINDS at a random step, and judge what the run left behind.

    python scripts/chaos.py --runs 24 [--steps 8] [--seed 0] [--kinds kill-rollout,disk-full]

Each fault kind has an expected outcome (FAULTS below says which); a run counts as
  lost          a buffer or a group member never trained, or a run that had to finish and did not
  duplicated    a buffer, a prompt group or a trajectory trained twice: found by the trainer's own
                content digests of what it trained (trained.jsonl ``content``), by prompt and by id
  hang          a phase that did not exit within --timeout
  leak          a process of the run, or a /dev/shm segment it created, still there at the end
  code_executed a crafted input (a pickle payload in a checkpoint, a planted shm file, the rendezvous
                store; custom code in a model folder) ran code: the payload would create a canary file
  not_injected  the fault never happened (nothing killed, the limit never hit): a failure, never ok
  wrong_outcome the run did not behave as its kind promises (no one-line error, a stop not
                detected within the stall limit, a torn checkpoint left, ...)
One line per run, then one JSON line with every count; exit 1 when any count but runs/kinds is
not zero. Needs tests/ on PYTHONPATH (the tiny runs score with e2e_rewards:text_length).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from chaos_faults import SCENARIO, STALL_FLOOR_S, cmdline, tagged  # noqa: E402

B, N, ETA = 4, 4, 1  # the tiny preset's batch size, group size and eta
REWARD_FN = "e2e_rewards:text_length"
FAULTS = {  # kind -> expected outcome
    "kill-controller": "SIGKILL: elastic restart from the newest checkpoint, every buffer trained once, exit 0",
    "kill-trainer": "SIGKILL: elastic restart from the newest checkpoint, every buffer trained once, exit 0",
    "kill-rollout": "SIGKILL: elastic restart from the newest checkpoint, every buffer trained once, exit 0",
    "stop-controller": "SIGSTOP: ranks miss its heartbeat; restart, finish, exit 0; the stopped process gone",
    "stop-trainer": "SIGSTOP: stall detected (killed) within the stall limit; restart, finish, exit 0",
    "stop-rollout": "SIGSTOP: stall detected (killed) within the stall limit; restart, finish, exit 0",
    "kill-checkpoint-write": "SIGKILL of the trainer mid-write: the partial folder is never used or left; exit 0",
    "kill-reward": "SIGKILL of a reward worker: its score counts as an error (0), the run finishes, exit 0",
    "disk-full": "file size limit on the trainer: one-line disk error, exit 2, last checkpoint intact; "
    "--resume then finishes",
    "torn-log": "power loss (everything SIGKILLed) + half-written log lines: --resume drops them, finishes",
    "planted-shm": "a file planted under the run's segment name: refused naming it, no code run; restart, exit 0",
    "crafted-checkpoint": "the newest checkpoint replaced by a crafted file (manifest updated): --resume refuses "
    "it in one line, exit != 0, no code run",
    "multinode-kill-rollout": "SIGKILL of a rollout rank on the second torchrun agent: both agents stop naming "
    "it, a checkpoint saved; --resume finishes",
    "rendezvous-payload": "a pickle payload set as the rendezvous state (port and id read from /proc): the agent "
    "refuses it in one line and stops, nothing runs (canary), no process left; --resume finishes",
    "agent-killed": "SIGKILL of the torchrun agent: every rank, the controller and the reward workers gone within "
    "90 s, no /dev/shm segment left; --resume finishes",
    "second-writer": "launch.sh --resume on the live run folder: refused in one line naming rank 0's pid, exit 2; "
    "the first run finishes, exit 0",
    "crafted-checkpoint-values": "version 10**20, a null files entry, a name outside the folder (manifest "
    "rewritten): --resume skips it, resumes from the older checkpoint and finishes, exit 0",
    "crafted-model-folder": "a million layers, vocab 1e12, RoPE factor 1e300, auto_map in config.json or the "
    "tokenizer: refused by check in one line naming the file, exit 2, nothing started or run",
    "resume-code": "a module planted in a finished run's folder (under runs/, importable) and named by its "
    "config.json's reward.fn, then train.loss: --resume refused in one line, exit 2, the module never imported",
    "reward-hack": "the code_tests reward in the real reward pool: six wrong solutions with exit/marker/kill/"
    "atexit/patched-builtins tricks score 0 without a reward error, the honest one 1",
    "env-hostile": "an environment that meets 1,200 '[' in a tool call, raises, fakes a turn with special "
    "tokens, returns a wrong type and times out, every trajectory: the run finishes, every buffer once, exit 0",
    "yaml-bomb": "a 731-byte --config of 26 levels of YAML anchors: refused in one line before expansion, exit 2",
    "template-bomb": "a chat template of nested range(100000) loops, then a recursive macro: refused in one "
    "line within the render budget, exit 2",
    "index-escape": "model.safetensors.index.json with '../', an absolute shard, 100,000-deep JSON: one line, exit 2",
    "data-bomb": "a 9 KB zstd parquet of one 256 MB prompt, a save_to_disk state.json naming ../secret/x.arrow, "
    "a FIFO as the data file: each one line, exit 2, no hang",
    "feature-fifo": "a parquet column declared Image pointing at a FIFO: never decoded; the run finishes, exit 0",
    "fifo-lock": "run.lock replaced by a FIFO: --resume refused in one line naming the rm, exit 2; removed, "
    "--resume finishes",
    "bad-rows": "a bad row at row 40 of 64: --data.bad-rows error refused in one line naming row 40, exit 2; "
    "skip prints the summary and trains to the end, exit 0",
}
KINDS = tuple(FAULTS)


class Run:
    def __init__(self, i: int, kind: str, args, rng: random.Random, root: Path):
        from staleflow.servers.segment import list_segments

        self.i, self.kind, self.args, self.root = i, kind, args, root
        self.tag, self.name = uuid.uuid4().hex, f"chaos-{i}-{kind}"
        self.dir = root / self.name
        self.at = rng.randint(2, args.steps - 3)
        self.seed = rng.randint(0, 10_000)
        self.canary = root / f"canary-{i}"
        self.shm_before = set(list_segments())
        self.ours: set[int] = set()
        self.injected, self.hang = False, False
        self.wrong: list[str] = []
        self.exits: list[int | None] = []
        self.out = ""
        self.steps = args.steps  # buffers the run must have trained exactly once at the end
        self.full = True  # the run had to finish all its steps
        self.planted: Path | None = None
        self.phase = 0
        self.left: list[str] = []  # processes still running after their phase ended
        self.kind_note = ""

    def env(self, **extra) -> dict:
        path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
        return dict(os.environ, STALEFLOW_CHAOS_TAG=self.tag, PYTHONPATH=path, **extra)

    def train_args(self) -> list[str]:
        return [
            "--preset",
            "tiny",
            "--steps",
            str(self.args.steps),
            "--checkpoint.every",
            "2",
            "--log.run-dir",
            str(self.root),
            "--log.name",
            self.name,
            "--log.no-progress",
            "--log.no-plot",
            "--reward.fn",
            REWARD_FN,
            "--fault.stall-floor-s",
            str(STALL_FLOOR_S),
            "--seed",
            str(self.seed),
        ]

    def launch(self, *extra: str, resume: bool = False, nproc: int | None = None) -> subprocess.Popen:
        # A resumed run's saved config never chooses code (launch/saved_code.py): the reward function
        # of tests/, under the working directory, is named again, as a user resuming it would.
        again = ["--reward.fn", REWARD_FN]
        args = ["--resume", str(self.dir), *again, *extra] if resume else [*self.train_args(), *extra]
        env = self.env(**({"NPROC": str(nproc)} if nproc else {}))
        return self._popen(["bash", str(ROOT / "launch.sh"), *args], env)

    def _popen(self, cmd: list[str], env: dict) -> subprocess.Popen:
        self.phase += 1
        log = open(self.root / f"{self.name}.{self.phase}.log", "w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)

    def watch(self, procs: list[subprocess.Popen], tick=None, poll: float = 0.1) -> str:
        """Wait for every process of a phase (calling tick meanwhile); returns the phase's output."""
        deadline = time.monotonic() + self.args.timeout
        next_scan = 0.0
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if time.monotonic() >= next_scan:  # every pid of the run: shm segments are attributed by them
                self.ours.update(tagged(self.tag))
                next_scan = time.monotonic() + 1.0
            if tick is not None:
                tick()
            time.sleep(poll)
        if any(p.poll() is None for p in procs):
            self.hang = True
        else:  # processes of the phase may take a moment to exit after its launcher did
            gone_by = time.monotonic() + 20
            while tagged(self.tag) and time.monotonic() < gone_by:
                time.sleep(0.2)
            self.left += [f"{pid} {cmdline(pid)[:60]}" for pid in tagged(self.tag)]
        self.kill_all()
        for p in procs:
            p.wait()
        self.exits += [p.returncode for p in procs]
        out = "".join((self.root / f"{self.name}.{k}.log").read_text(errors="replace") for k in self.phases(procs))
        self.out += out
        return out

    def phases(self, procs) -> list[int]:
        return list(range(self.phase - len(procs) + 1, self.phase + 1))

    def kill_all(self) -> None:
        for pid in tagged(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        gone_by = time.monotonic() + 10
        while tagged(self.tag) and time.monotonic() < gone_by:
            time.sleep(0.1)

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.wrong.append(what)


# ---- the faults ----------------------------------------------------------------------------


def judge(report, *, finished: bool, hang: bool, leaked: list[str], canary: bool, injected: bool, wrong: list[str]):
    """The counts of one run from its audit (staleflow.metrics.audit.Audit) and what was observed.
    ``finished``: the run trained every step it had to (else its buffers are lost)."""
    return {
        "lost": bool(report.lost) or (not finished and not hang),
        "duplicated": bool(report.duplicated),
        "hang": hang,
        "leak": bool(leaked),
        "code_executed": canary,
        "not_injected": not injected,
        "wrong_outcome": bool(wrong or report.other),
    }


def one_run(i: int, kind: str, args, rng: random.Random, root: Path) -> dict:
    from staleflow.metrics.audit import audit_run
    from staleflow.servers.segment import list_segments, segment_owner

    run = Run(i, kind, args, rng, root)
    try:
        SCENARIO[kind](run)
    except Exception as e:  # a fault that could not be carried out is a failed run, never a crash of the rest
        run.wrong.append(f"chaos error: {type(e).__name__}: {e}")
    finally:
        run.kill_all()
    steps = run.steps
    if kind == "crafted-checkpoint" and run.exits and run.exits[-1] == 0:
        steps += 2  # the crafted checkpoint was skipped for an older one and the run went on
    report = audit_run(run.dir, steps, batch_size=B, group_size=N, eta=ETA, require_content=True)
    must_finish = run.full and kind != "crafted-checkpoint"  # refused runs (crafted input) never train
    finished = bool(run.exits) and (run.exits[-1] == 0 or not must_finish) and not report.lost
    left = run.left
    shm = [n for n in list_segments() if n not in run.shm_before and (segment_owner(n) or (0,))[0] in run.ours]
    counts = judge(
        report,
        finished=finished,
        hang=run.hang,
        leaked=left + shm,
        canary=run.canary.exists(),
        injected=run.injected,
        wrong=run.wrong,
    )
    problems = report.problems[:3] + run.wrong[:3] + ([f"left: {left + shm}"] if left or shm else [])
    return {"kind": kind, "note": run.kind_note, "at": run.at, "exits": run.exits, "problems": problems, **counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=len(KINDS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds, taken round-robin")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a phase of a run counts as hung")
    ap.add_argument(
        "--keep", default="", help="a folder to keep the runs' folders and logs in (default: a temporary one)"
    )
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in FAULTS]
    if bad:
        raise SystemExit(f"--kinds: unknown {bad}; the kinds are {', '.join(KINDS)}")
    if args.steps < 5:
        raise SystemExit(f"--steps {args.steps} is too few: >= 5 (a fault lands after a checkpoint, before the end)")
    rng = random.Random(args.seed)
    keys = ("lost", "duplicated", "hang", "leak", "code_executed", "not_injected", "wrong_outcome")
    counts = dict.fromkeys(("runs", "kinds", *keys), 0)
    seen: set[str] = set()
    t_start = time.monotonic()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="staleflow-chaos-", dir=args.keep or None))
    try:
        for i in range(args.runs):
            kind = kinds[i % len(kinds)]
            t0 = time.monotonic()
            row = one_run(i, kind, args, rng, root)
            seen.add(kind)
            counts["runs"] += 1
            for k in keys:
                counts[k] += row[k]
            bad_keys = [k for k in keys if row[k]]
            print(
                f"run {i}: {kind}{' (' + row['note'] + ')' if row['note'] else ''} after step {row['at']}: "
                f"exits {row['exits']}, {time.monotonic() - t0:.0f} s, "
                + (f"FAILED {bad_keys} {row['problems']}" if bad_keys else "ok"),
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    counts["kinds"] = len(seen)
    result = {
        "runs": counts["runs"],
        "kinds": counts["kinds"],
        "lost": counts["lost"],
        "duplicated": counts["duplicated"],
        "hangs": counts["hang"],
        "leaks": counts["leak"],
        "code_executed": counts["code_executed"],
        "not_injected": counts["not_injected"],
        "wrong_outcome": counts["wrong_outcome"],
        "wall_s": round(time.monotonic() - t_start),
    }
    print(json.dumps(result))
    sys.exit(1 if any(v for k, v in result.items() if k not in ("runs", "kinds", "wall_s")) else 0)


if __name__ == "__main__":
    main()
