"""The fault injectors of scripts/chaos.py (each takes the chaos.Run it acts on): finding a run's processes by
tag and title, signalling a role, killing during a checkpoint write, a file-size limit, torn log
lines, a planted shared-memory file, crafted checkpoints, a second torchrun agent; the hostile-input
kinds (rendezvous payload, agent killed, second writer, crafted values and model folders) are in
chaos_hostile.py."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chaos import Run

ROOT = Path(__file__).resolve().parents[1]
STALL_FLOOR_S = 60.0  # starved ranks (this machine is shared and the runs niced) must not look stuck
HEARTBEAT_S = 60.0  # the ranks' default STALEFLOW_HEARTBEAT_TIMEOUT_S: a stopped controller is missed after it
TITLE = {
    "controller": "staleflow[controller]",
    "trainer": "staleflow[trainer 0]",
    "rollout": "staleflow[rollout 1]",
    "reward": "staleflow[reward 0]",
}


def tail(out: str, n: int = 3) -> str:
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith(("W1", "I1"))]
    return " | ".join(lines[-n:])[-600:]


# ---- judging -------------------------------------------------------------------------------
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
    from staleflow.runfolder.scratch import OWNER_FILE, RUN_FOLDER_PREFIX
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

from chaos_hostile import HOSTILE  # noqa: E402 - it uses the helpers above
from chaos_inputs import INPUTS  # noqa: E402 - issue 50's hostile inputs, the same helpers

SCENARIO.update(HOSTILE)
SCENARIO.update(INPUTS)
