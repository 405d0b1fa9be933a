"""Chaos runs: start the real system (launch.sh, tiny model) once per run, inject one fault of a
kind taken round-robin from KINDS at a random step, and judge what the run left behind.

    python scripts/chaos.py --runs 24 [--steps 8] [--seed 0] [--kinds kill-rollout,disk-full]

Each fault kind has an expected outcome (FAULTS below says which); a run counts as
  lost          a buffer or a group member never trained, or a run that had to finish and did not
  duplicated    a buffer, a prompt group or a trajectory trained twice: found by the trainer's own
                content digests of what it trained (trained.jsonl ``content``), by prompt and by id
  hang          a phase that did not exit within --timeout
  leak          a process of the run, or a /dev/shm segment it created, still there at the end
  code_executed a crafted input (a pickle payload in a checkpoint or a planted shm file) ran code:
                the payload would create a canary file
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
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, N, ETA = 4, 4, 1  # the tiny preset's batch size, group size and eta
STALL_FLOOR_S = 60.0  # starved ranks (this machine is shared and the runs niced) must not look stuck
HEARTBEAT_S = 60.0  # the ranks' default STALEFLOW_HEARTBEAT_TIMEOUT_S: a stopped controller is missed after it
TITLE = {
    "controller": "staleflow[controller]",
    "trainer": "staleflow[trainer 0]",
    "rollout": "staleflow[rollout 1]",
    "reward": "staleflow[reward 0]",
}
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
}
KINDS = tuple(FAULTS)


# ---- processes -----------------------------------------------------------------------------
def tagged(tag: str) -> list[int]:
    """Live (not zombie) processes whose environment carries this run's tag."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"STALEFLOW_CHAOS_TAG={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                if state(int(pid)) not in ("Z", ""):
                    out.append(int(pid))
        except OSError:
            continue
    return out


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (OSError, IndexError):
        return ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip().decode(errors="replace")
    except OSError:
        return ""


def titled(tag: str, title: str) -> list[int]:
    return [p for p in tagged(tag) if cmdline(p).startswith(title)]


def rows(path: Path) -> list[dict]:
    from staleflow.durable import read_jsonl

    return read_jsonl(path)[0] if path.exists() else []


def last_step(run: Path) -> int:
    return max((r["step"] for r in rows(run / "metrics.jsonl") if "step" in r and "eval_n" not in r), default=-1)


def checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in (run / "checkpoints").glob("step_*") if (p / "manifest.json").is_file())


def pickle_canary(marker: Path) -> bytes:
    """A pickle stream that runs ``touch marker`` when unpickled (protocol 0, written by hand: this
    script never unpickles anything); the marker's existence means a reader executed it."""
    return b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."


# ---- one run -------------------------------------------------------------------------------
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
            "e2e_rewards:text_length",
            "--fault.stall-floor-s",
            str(STALL_FLOOR_S),
            "--seed",
            str(self.seed),
        ]

    def launch(self, *extra: str, resume: bool = False, nproc: int | None = None) -> subprocess.Popen:
        args = ["--resume", str(self.dir), *extra] if resume else [*self.train_args(), *extra]
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
def signal_role(run: Run, role: str, sig: int) -> None:
    """SIGKILL or SIGSTOP one process of a role after step `at`; a stopped one must be detected
    (gone) within the stall limit (or the heartbeat timeout, for the controller)."""
    victim: dict = {}

    def tick():
        if not run.injected and last_step(run.dir) >= run.at:
            pids = titled(run.tag, TITLE[role])
            if pids:
                os.kill(pids[0], sig)
                time.sleep(0.05)
                if sig == signal.SIGKILL or state(pids[0]) == "T":
                    run.injected, victim["pid"], victim["t"] = True, pids[0], time.monotonic()
        elif run.injected and "gone" not in victim and state(victim["pid"]) in ("", "Z"):
            victim["gone"] = time.monotonic() - victim["t"]

    p = run.launch()
    out = run.watch([p], tick)
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]}, not 0: {tail(out)}")
    if sig == signal.SIGSTOP and run.injected:
        # the hub kills a stopped rank after the stall limit; the ranks give up on a silent controller
        # after their heartbeat timeout, and rank 0 kills it 5 s later
        limit = (HEARTBEAT_S + 15.0 if role == "controller" else STALL_FLOOR_S) + 30.0
        gone = victim.get("gone")
        run.kind_note = f"gone {gone:.0f} s after SIGSTOP" if gone is not None else "never gone"
        run.expect(gone is not None and gone <= limit, f"the stopped {role} was gone after {gone} s (limit {limit})")


def kill_checkpoint_write(run: Run) -> None:
    """SIGKILL the trainer while its rank file of a checkpoint is being written."""

    armed = {"at": 0.0, "ok": False}

    def tick():
        if run.injected:
            return
        if not armed["ok"] and time.monotonic() >= armed["at"]:  # the step is read twice a second
            armed["ok"], armed["at"] = last_step(run.dir) >= run.at, time.monotonic() + 0.5
        if armed["ok"] and any((run.dir / "checkpoints").glob(".tmp-*/rank_0.safetensors")):
            for pid in titled(run.tag, TITLE["trainer"]):
                os.kill(pid, signal.SIGKILL)
                run.injected = True

    p = run.launch()
    out = run.watch([p], tick, poll=0.005)
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]}, not 0: {tail(out)}")
    left = list((run.dir / "checkpoints").glob(".tmp-*"))
    run.expect(not left, f"a partial checkpoint folder is left: {left}")


def disk_full(run: Run) -> None:
    """RLIMIT_FSIZE (1 MiB) on the trainer once a checkpoint exists: its next save fails EFBIG."""
    from staleflow.train.checkpoint import CheckpointError, verify_checkpoint

    def tick():
        if not run.injected and last_step(run.dir) >= run.at and checkpoints(run.dir):
            for pid in titled(run.tag, TITLE["trainer"]):
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
                run.injected = True

    p = run.launch()
    out = run.watch([p], tick)
    hit = "file size limit" in out
    if not hit:
        run.injected = False  # the limit was set but no save ran into it
    run.expect(run.exits[-1] == 2, f"exit {run.exits[-1]}, not 2 (a disk error): {tail(out)}")
    run.expect(out.count("file size limit") >= 1 and "Traceback" not in out, f"not one clear line: {tail(out)}")
    try:
        verify_checkpoint(checkpoints(run.dir)[-1])
    except (CheckpointError, IndexError) as e:
        run.wrong.append(f"the last checkpoint is not intact: {e}")
    run.expect(not list((run.dir / "checkpoints").glob(".tmp-*")), "a partial checkpoint folder is left")
    out = run.watch([run.launch(resume=True)])  # room again: the run goes on from its checkpoint
    run.expect(run.exits[-1] == 0, f"--resume exit {run.exits[-1]}, not 0: {tail(out)}")


def torn_log(run: Run) -> None:
    """Everything SIGKILLed at once (a power loss) after a checkpoint, then half-written last lines
    in trained.jsonl and metrics.jsonl; --resume must drop them and finish."""

    def tick():
        if not run.injected and last_step(run.dir) >= run.at and checkpoints(run.dir):
            run.kill_all()
            with open(run.dir / "trained.jsonl", "a") as f:
                f.write('{"buffer": 1, "group_id": 3, "traj_version": 0, "traj_ids": [12, 1')
            with open(run.dir / "metrics.jsonl", "a") as f:
                f.write('{"step": 3, "reward_mean": 0.2')
            run.injected = True

    run.watch([run.launch()], tick)
    out = run.watch([run.launch(resume=True)])
    run.expect(run.exits[-1] == 0, f"--resume exit {run.exits[-1]}, not 0: {tail(out)}")
    run.expect("torn by a crash" in out, "--resume did not say it dropped the torn lines")


def planted_shm(run: Run) -> None:
    """A file planted in /dev/shm under the name of the run's first Parameter Server slot as soon
    as the run id is known (rank 0's claimed folder), holding a pickle payload: the trainer must
    refuse the name in one line; nothing may read the payload."""
    from staleflow.launch.cleanup import OWNER_FILE, RUN_FOLDER_PREFIX
    from staleflow.servers.segment import segment_path

    before = set(Path(tempfile.gettempdir()).glob(RUN_FOLDER_PREFIX + "*"))

    def tick():
        if run.planted is not None:
            return
        for folder in set(Path(tempfile.gettempdir()).glob(RUN_FOLDER_PREFIX + "*")) - before:
            try:
                pid = int((folder / OWNER_FILE).read_text())
                if f"STALEFLOW_CHAOS_TAG={run.tag}".encode() not in Path(f"/proc/{pid}/environ").read_bytes():
                    continue
            except (OSError, ValueError):
                continue
            path = Path(segment_path(f"staleflow-{folder.name.removeprefix(RUN_FOLDER_PREFIX)}-ps-0"))
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                run.planted = Path("/nonexistent")  # too late: the run created it first
                return
            os.write(fd, pickle_canary(run.canary) + b"\0" * 4096)
            os.close(fd)
            run.planted = path

    out = run.watch([run.launch()], tick, poll=0.02)
    run.injected = run.planted is not None and str(run.planted) in out  # planted, and the run met it
    refusals = [line for line in out.splitlines() if line.startswith("staleflow:") and str(run.planted) in line]
    run.expect(bool(refusals), f"no one-line refusal naming {run.planted}: {tail(out)}")
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]}, not 0 (a restart with a new run id): {tail(out)}")
    if run.planted is not None and run.planted.exists():
        run.planted.unlink()


CRAFTS = ("pickle-as-safetensors", "huge-offsets", "dcp-metadata")


def craft(ck: Path, variant: str, canary: Path) -> None:
    """Tamper with checkpoint folder ``ck`` and rewrite its manifest to match (the manifest detects
    corruption, not tampering): a pickle payload as rank_0.safetensors, a safetensors header whose
    offsets point far past the file, or a torch DCP ``.metadata`` pickle instead of state.json."""
    import hashlib

    manifest = json.loads((ck / "manifest.json").read_text())
    if variant == "pickle-as-safetensors":
        target, data = "rank_0.safetensors", pickle_canary(canary)
    elif variant == "huge-offsets":
        head = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}).encode()
        target, data = "rank_0.safetensors", len(head).to_bytes(8, "little") + head + b"\0" * 64
    else:
        (ck / "state.json").unlink()
        manifest["files"].pop("state.json")
        target, data = ".metadata", pickle_canary(canary)
    (ck / target).write_bytes(data)
    manifest["files"][target] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / "manifest.json").write_text(json.dumps(manifest))


def crafted_checkpoint(run: Run) -> None:
    """A finished run's newest checkpoint crafted three ways (CRAFTS), each followed by --resume
    with two more steps: every one must be refused in one line naming it, and run no code."""
    out = run.watch([run.launch()])
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]}, not 0 before the checkpoint was crafted: {tail(out)}")
    found = checkpoints(run.dir)
    if not found:
        return
    ck, keep = found[-1], run.root / f"{run.name}.original"
    shutil.copytree(ck, keep)
    met = []
    for variant in CRAFTS:
        shutil.rmtree(ck)
        shutil.copytree(keep, ck)
        craft(ck, variant, run.canary)
        out = run.watch([run.launch("--steps", str(run.args.steps + 2), resume=True)])
        met.append(ck.name in out)
        run.expect(run.exits[-1] not in (0, None), f"{variant}: --resume exited {run.exits[-1]}, not refused")
        refusals = [line for line in out.splitlines() if ck.name in line and ("refused" in line or "cannot" in line)]
        run.expect(bool(refusals), f"{variant}: no one-line refusal naming {ck.name}: {tail(out)}")
    run.injected = all(met)
    run.kind_note = "+".join(CRAFTS)


def multinode_kill_rollout(run: Run) -> None:
    """Two torchrun agents on this machine (2 ranks each: trainers on node 0, rollout ranks 2-3 on
    node 1); rollout instance 0 (rank 2, on node 1) is SIGKILLed; then --resume on one node."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
        cmd += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd += ["-m", "staleflow", "train", *run.train_args(), "--rollout.ranks", "2"]
        procs.append(run._popen(cmd, run.env()))

    def tick():
        if not run.injected and last_step(run.dir) >= run.at:
            for pid in titled(run.tag, "staleflow[rollout 0]"):
                os.kill(pid, signal.SIGKILL)
                run.injected = True

    out = run.watch(procs, tick)
    run.expect(all(c not in (0, None) for c in run.exits[-2:]), f"agents exited {run.exits[-2:]}, not both non-zero")
    run.expect("rank 2 (rollout instance 0, node 1" in out, f"the dead rank is not named: {tail(out)}")
    out = run.watch([run.launch(resume=True, nproc=4)])
    run.expect(run.exits[-1] == 0, f"--resume exit {run.exits[-1]}, not 0: {tail(out)}")


SCENARIO = {
    "kill-controller": lambda r: signal_role(r, "controller", signal.SIGKILL),
    "kill-trainer": lambda r: signal_role(r, "trainer", signal.SIGKILL),
    "kill-rollout": lambda r: signal_role(r, "rollout", signal.SIGKILL),
    "stop-controller": lambda r: signal_role(r, "controller", signal.SIGSTOP),
    "stop-trainer": lambda r: signal_role(r, "trainer", signal.SIGSTOP),
    "stop-rollout": lambda r: signal_role(r, "rollout", signal.SIGSTOP),
    "kill-checkpoint-write": kill_checkpoint_write,
    "kill-reward": lambda r: signal_role(r, "reward", signal.SIGKILL),
    "disk-full": disk_full,
    "torn-log": torn_log,
    "planted-shm": planted_shm,
    "crafted-checkpoint": crafted_checkpoint,
    "multinode-kill-rollout": multinode_kill_rollout,
}


def tail(out: str, n: int = 3) -> str:
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith(("W1", "I1"))]
    return " | ".join(lines[-n:])[-600:]


# ---- judging -------------------------------------------------------------------------------
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
    finished = bool(run.exits) and (run.exits[-1] == 0 or kind == "crafted-checkpoint") and not report.lost
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
