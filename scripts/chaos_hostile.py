"""The hostile-input faults of scripts/chaos.py (imported through chaos_faults.SCENARIO): an attacker's
pickle in torchrun's rendezvous store, the torchrun agent killed, a second writer on a live run
folder, crafted checkpoint values, a crafted model folder. Each takes the chaos.Run it acts on and
records what it saw with run.expect / run.injected; a canary file means a payload ran."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from chaos_faults import ROOT, TITLE, checkpoints, cmdline, last_step, pickle_canary, tagged, tail, titled

if TYPE_CHECKING:
    from chaos import Run

AGENT = "staleflow.launch.torchrun"
AGENT_GONE_S = 90.0
"""After the agent's SIGKILL: every process of the run gone within this (a trainer may save first)."""


def _agent(run: Run) -> int | None:
    found = [p for p in tagged(run.tag) if AGENT in cmdline(p)]
    return found[0] if found else None


def rendezvous_payload(run: Run) -> None:
    """Read the agent's rendezvous port and id from /proc as any local user can, set the rendezvous
    key to a pickle that would create the canary: the agent refuses it in one line and stops (nothing
    runs), every process of the run goes with it, and --resume finishes."""
    import torch.distributed as dist

    def tick():
        if run.injected or last_step(run.dir) < run.at:
            return
        pid = _agent(run)
        if pid is None:
            return
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        port = int(argv[argv.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1])
        key = f"torch.rendezvous.{argv[argv.index('--rdzv-id') + 1]}"
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        store.set(key, base64.b64encode(pickle_canary(run.canary)))
        run.injected = True

    out = run.watch([run.launch()], tick)
    refusals = [line for line in out.splitlines() if line.startswith("staleflow: refused the rendezvous state")]
    run.expect(len(refusals) == 1, f"not one refusal line: {tail(out)}")
    run.expect(run.exits[-1] not in (0, None), f"exit {run.exits[-1]}: the agent went on with a foreign state")
    out = run.watch([run.launch(resume=True)])
    run.expect(run.exits[-1] == 0, f"--resume exit {run.exits[-1]}, not 0: {tail(out)}")


def agent_killed(run: Run) -> None:
    """SIGKILL of the torchrun agent after step k: launch.sh exits at once, every rank, the controller
    and the reward workers stop by themselves (parent-death signal) within AGENT_GONE_S, no /dev/shm
    segment is left; --resume then finishes."""

    def tick():
        if run.injected or last_step(run.dir) < run.at:
            return
        pid = _agent(run)
        if pid is None or not titled(run.tag, TITLE["reward"]):
            return
        os.kill(pid, signal.SIGKILL)
        run.injected, t0 = True, time.monotonic()
        while [p for p in tagged(run.tag) if "launch.sh" not in cmdline(p)] and time.monotonic() < t0 + AGENT_GONE_S:
            time.sleep(0.2)
        left = [f"{p} {cmdline(p)[:40]}" for p in tagged(run.tag) if "launch.sh" not in cmdline(p)]
        run.kind_note = f"all gone {time.monotonic() - t0:.0f} s after the agent" if not left else "some left"
        run.expect(not left, f"still running {AGENT_GONE_S:.0f} s after the agent died: {left}")

    out = run.watch([run.launch()], tick)
    run.expect(run.exits[-1] != 0, f"launch.sh exited {run.exits[-1]} after its agent was killed: {tail(out)}")
    out = run.watch([run.launch(resume=True)])
    run.expect(run.exits[-1] == 0, f"--resume exit {run.exits[-1]}, not 0: {tail(out)}")


def second_writer(run: Run) -> None:
    """While the run trains, ./launch.sh --resume on its folder: refused in one line naming the live
    pid (exit 2, nothing started); the first run finishes undisturbed."""
    second: dict = {}

    def tick():
        if second or last_step(run.dir) < 1:  # early: the second launch.sh takes seconds to reach its check
            return
        rank0 = titled(run.tag, TITLE["trainer"])
        if not rank0:
            return
        cmd = ["bash", str(ROOT / "launch.sh"), "--resume", str(run.dir)]  # waited for inside the first run's watch
        res = subprocess.run(cmd, env=run.env(), cwd=ROOT, capture_output=True, text=True, timeout=run.args.timeout)
        second.update(exit=res.returncode, pid=rank0[0], out=res.stdout + res.stderr)
        run.injected = rank0[0] in titled(run.tag, TITLE["trainer"])  # the first run was live throughout

    run.steps += 6  # a longer first run: it must still be writing when the second one checks
    out = run.watch([run.launch("--steps", str(run.steps))], tick)
    run.expect(run.exits[-1] == 0, f"the first run exited {run.exits[-1]}, not 0: {tail(out)}")
    if second:
        lines = [line for line in second["out"].splitlines() if line.strip()]
        run.expect(second["exit"] == 2, f"the second writer exited {second['exit']}, not 2")
        run.expect(
            len(lines) == 1 and f"pid {second['pid']}" in lines[0],
            f"the second writer's refusal is not one line naming pid {second['pid']}: {' | '.join(lines[-3:])}",
        )


def _edit_state(ck: Path, change) -> None:
    state = json.loads((ck / "trainer_state.json").read_text())
    change(state)
    (ck / "trainer_state.json").write_text(json.dumps(state))
    data = (ck / "trainer_state.json").read_bytes()
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / "manifest.json").write_text(json.dumps(manifest))


def _edit_manifest(ck: Path, change) -> None:
    manifest = json.loads((ck / "manifest.json").read_text())
    change(ck, manifest)
    (ck / "manifest.json").write_text(json.dumps(manifest))


def _outside(ck: Path, manifest: dict) -> None:
    outside = ck.parent.parent / "outside.txt"
    outside.write_text("outside")
    data = outside.read_bytes()
    manifest["files"]["../../outside.txt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


VALUE_CRAFTS = {
    "version-1e20": lambda ck: _edit_state(ck, lambda s: s.update(version=10**20)),
    "files-entry-null": lambda ck: _edit_manifest(ck, lambda c, m: m["files"].update({"state.json": None})),
    "path-outside": lambda ck: _edit_manifest(ck, _outside),
}


def crafted_checkpoint_values(run: Run) -> None:
    """A finished run's newest checkpoint crafted (manifest rewritten to match): a version of 10**20,
    a files entry that is null, a name leaving the folder. Each --resume (2 more steps) must skip it
    with a warning, resume from the older intact checkpoint and finish: no traceback, exit 0."""
    out = run.watch([run.launch()])
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]}, not 0 before the checkpoint was crafted: {tail(out)}")
    met = []
    for variant, craft in VALUE_CRAFTS.items():
        found = checkpoints(run.dir)
        if len(found) < 2:
            run.wrong.append(f"{variant}: fewer than two checkpoints to fall back between")
            return
        craft(found[-1])
        run.steps += 2
        out = run.watch([run.launch("--steps", str(run.steps), resume=True)])
        met.append(f"skipping checkpoint {found[-1].name}" in out)
        run.expect(run.exits[-1] == 0, f"{variant}: --resume exited {run.exits[-1]}, not 0: {tail(out)}")
        run.expect("Traceback" not in out, f"{variant}: a traceback: {tail(out)}")
    run.injected = all(met)
    run.kind_note = "+".join(VALUE_CRAFTS)


MODEL_CRAFTS = {
    "layers-1e6": {"num_hidden_layers": 1000000},
    "vocab-1e12": {"vocab_size": 1e12},
    "rope-1e300": {"rope_parameters": {"rope_type": "linear", "factor": 1e300}},
    "auto-map": {"auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}},
    "tokenizer-auto-map": None,
}


def crafted_model_folder(run: Run) -> None:
    """The tiny model's folder copied and crafted five ways (absurd sizes, a RoPE factor of 1e300,
    auto_map in config.json, a tokenizer whose auto_map names code that would create the canary):
    ./launch.sh --model.path FOLDER is refused by `staleflow check` in one line naming config.json or
    tokenizer_config.json, exit 2, no process started, nothing run."""
    from staleflow.model.loader import resolve_model_path

    tiny = Path(resolve_model_path("tiny-llama"))
    run.full, run.steps, met = False, 0, []
    for variant, change in MODEL_CRAFTS.items():
        folder = run.root / f"{run.name}-model-{variant}"
        shutil.copytree(tiny, folder, ignore=shutil.ignore_patterns(".staleflow-*"))
        if change is None:
            (folder / "tokenization_evil.py").write_text(f"open({str(run.canary)!r}, 'w').write('ran')\n")
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
            (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        else:
            cfg = json.loads((folder / "config.json").read_text())
            cfg.update(change)
            (folder / "config.json").write_text(json.dumps(cfg))
        out = run.watch([run.launch("--model.path", str(folder))])
        lines = [line for line in out.splitlines() if line.strip()]
        named = "tokenizer_config.json" if change is None else "config.json"
        met.append(bool(lines) and named in lines[-1])
        run.expect(run.exits[-1] == 2, f"{variant}: exit {run.exits[-1]}, not 2: {tail(out)}")
        run.expect(len(lines) == 1 and named in lines[0], f"{variant}: not one line naming {named}: {tail(out)}")
        run.expect(not run.dir.exists(), f"{variant}: a run folder was created")
    run.injected = all(met)
    run.kind_note = "+".join(MODEL_CRAFTS)


HOSTILE = {
    "rendezvous-payload": rendezvous_payload,
    "agent-killed": agent_killed,
    "second-writer": second_writer,
    "crafted-checkpoint-values": crafted_checkpoint_values,
    "crafted-model-folder": crafted_model_folder,
}
