"""The hostile-input faults of issue 50 for scripts/chaos.py (imported through chaos_faults.SCENARIO): a run
folder that chooses code on --resume, a gamed code reward, a model and its environment misbehaving in
every way through the real rollout ranks, and bounded readers (a YAML alias bomb, runaway chat templates,
data bombs and escapes, a shard index leaving its folder, a FIFO as run.lock, bad data rows). Each takes
the chaos.Run it acts on and records what it saw with run.expect / run.injected; the canary file means
a payload ran."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from chaos_faults import ROOT, tail

REWARD_FN = "e2e_rewards:text_length"

if TYPE_CHECKING:
    from chaos import Run


def _refused(run: Run, out: str, variant: str, *needles: str) -> bool:
    """launch.sh stopped at its check: exit 2, one line holding ``needles``, no run folder."""
    lines = [line for line in out.splitlines() if line.strip()]
    one = len(lines) == 1 and all(n in lines[0] for n in needles)
    run.expect(run.exits[-1] == 2, f"{variant}: exit {run.exits[-1]}, not 2: {tail(out)}")
    run.expect(one, f"{variant}: not one line naming {needles}: {tail(out)}")
    return one


def _refusal_kind(run: Run) -> None:
    """A kind whose launches are all refused by check: no run trains, nothing is audited."""
    run.full, run.steps = False, 0


def resume_code(run: Run) -> None:
    """A finished run's folder, copied under the repository's runs/ (where `python -m` can import it),
    gets payload.py (it would create the canary) and its config.json's reward.fn, then train.loss, set to
    `runs.<folder>.payload:f`; `launch.sh --resume FOLDER` (for train.loss with the user's own reward
    named again) is refused by check in one line naming the planted spec, exit 2, nothing imported."""
    out = run.watch([run.launch()])
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]} before the folder was planted: {tail(out)}")
    run.full = False  # it trained every step (audited); the resumes below are refused by design
    name = f"chaos50_{run.tag[:12]}"
    victim = ROOT / "runs" / name
    shutil.copytree(run.dir, victim)
    original, met = run.dir, []
    try:
        (victim / "payload.py").write_text(f"open({str(run.canary)!r}, 'w').write('ran')\ndef f(*a):\n    return 1.0\n")
        for key, again in (("reward.fn", []), ("train.loss", ["--reward.fn", REWARD_FN])):
            cfg = json.loads((original / "config.json").read_text())
            section, field = key.split(".")
            cfg[section][field] = f"runs.{name}.payload:f"
            (victim / "config.json").write_text(json.dumps(cfg))
            run.dir = victim  # the user names their own reward again (train.loss), not the planted spec
            cmd = ["bash", str(ROOT / "launch.sh"), "--resume", str(victim), *again, "--steps", str(run.steps + 2)]
            out = run.watch([run._popen(cmd, run.env())])
            met.append(_refused(run, out, key, f"--{key.replace('_', '-')}='runs.{name}.payload:f'"))
    finally:
        run.dir = original
        shutil.rmtree(victim, ignore_errors=True)
    run.injected = all(met)
    run.kind_note = "reward.fn+train.loss"


REWARD_HACK = r"""
import json, sys
from staleflow.config import RewardConfig
from staleflow.reward import RewardPool
wrong = "def add(a, b):\n    return a - b\n"
hacks = {"sys.exit": "import sys\nsys.exit(0)", "os._exit": "import os\nos._exit(0)",
         "marker": "print('ALL TESTS PASSED')", "kill-parent": "import os\nos.kill(os.getppid(), 9)",
         "atexit": "import atexit, os\natexit.register(lambda: os._exit(0))",
         "builtins": "import builtins\nbuiltins.AssertionError = type('Q', (Exception,), {})"}
meta = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
with RewardPool(RewardConfig(fn="code_tests", workers=2, timeout_s=60.0)) as pool:
    for k, body in hacks.items():
        pool.submit(k, "```python\n" + wrong + body + "\n```", "", meta)
    pool.submit("honest", "```python\ndef add(a, b):\n    return a + b\n```", "", meta)
    print(json.dumps({k: [r, i.get("error")] for k, r, i in pool.drain(120.0)}))
"""


def reward_hack(run: Run) -> None:
    """The code_tests reward through the real reward pool (worker processes, the sandbox): six wrong
    solutions each with a trick (sys.exit, os._exit, a printed marker, killing the harness, atexit,
    patched AssertionError) score 0 without a reward error; the honest one scores 1."""
    _refusal_kind(run)
    out = run.watch([run._popen([sys.executable, "-c", REWARD_HACK], run.env())])
    try:
        got = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        run.wrong.append(f"no result: {tail(out)}")
        return
    run.injected = len(got) == 7
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]}: {tail(out)}")
    run.expect(got.get("honest") == [1.0, None], f"the honest solution scored {got.get('honest')}")
    paid = {k: v for k, v in got.items() if k != "honest" and v != [0.0, None]}
    run.expect(not paid, f"hacks not scored 0 without error: {paid}")
    run.kind_note = f"{len(got) - 1} hacks"


def env_hostile(run: Run) -> None:
    """A multi-turn run whose environment (tests/e2e_envs.py:HostileEnv) meets 1,200 '[' in a tool call,
    raises, returns a tool output faking a turn with special tokens, returns a wrong type and runs past
    the step timeout, every trajectory: the rollout ranks read each as an observation, the run finishes,
    every buffer trained once, exit 0."""
    out = run.watch(
        [run.launch("--env.name", "e2e_envs:HostileEnv", "--env.max-turns", "6", "--env.step-timeout-s", "1")]
    )
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]}: {tail(out)}")
    run.injected = "environment: HostileEnv RuntimeError" in out  # logged once by run_step: the failure happened
    run.kind_note = "parse+raise+specials+type+timeout"


def _bomb_yaml(path: Path) -> Path:
    lines = ["a0: &a0 [x]"] + [f"a{i}: &a{i} {{p: *a{i - 1}, q: *a{i - 1}}}" for i in range(1, 27)]
    path.write_text("\n".join(lines) + "\n")
    return path


def yaml_bomb(run: Run) -> None:
    """--config holding 26 levels of YAML anchors (731 bytes, 2**26 values expanded): one line, exit 2."""
    _refusal_kind(run)
    out = run.watch([run.launch("--config", str(_bomb_yaml(run.root / f"{run.name}.yaml")))])
    run.injected = _refused(run, out, "yaml", "expands to more than")


def _tiny_copy(run: Run, variant: str) -> Path:
    from staleflow.model.loader import resolve_model_path

    folder = run.root / f"{run.name}-model-{variant}"
    shutil.copytree(resolve_model_path("tiny-llama"), folder, ignore=shutil.ignore_patterns(".staleflow-*"))
    return folder


TEMPLATES = {
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "recursive-macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


def template_bomb(run: Run) -> None:
    """The tiny model with a chat template of nested range(100000) loops, then a recursive macro: check
    stops the rendering within its budget, one line naming the chat template, exit 2."""
    _refusal_kind(run)
    met = []
    for variant, template in TEMPLATES.items():
        folder = _tiny_copy(run, variant)
        (folder / "chat_template.jinja").write_text(template)
        out = run.watch([run.launch("--model.path", str(folder))])
        met.append(_refused(run, out, variant, "the chat template"))
    run.injected = all(met)
    run.kind_note = "+".join(TEMPLATES)


def index_escape(run: Run) -> None:
    """model.safetensors.index.json naming '../' and absolute shards, and 100,000-deep: one line each."""
    _refusal_kind(run)
    met = []
    for variant, body in (
        ("dotdot", json.dumps({"weight_map": {"x": "../outside.safetensors"}})),
        ("absolute", json.dumps({"weight_map": {"x": "/etc/hostname"}})),
        ("deep", '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ):
        folder = _tiny_copy(run, variant)
        (folder / "model.safetensors.index.json").write_text(body)
        out = run.watch([run.launch("--model.path", str(folder))])
        met.append(_refused(run, out, variant, "index"))
    run.injected = all(met)
    run.kind_note = "dotdot+absolute+deep"


BOMB = """
import sys, pyarrow as pa, pyarrow.parquet as pq
pq.write_table(pa.table({"prompt": ["x" * (256 << 20)], "answer": ["1"]}), sys.argv[1], compression="zstd")
"""


def data_bomb(run: Run) -> None:
    """A 9 KB zstd parquet of one 256 MB prompt; a save_to_disk folder whose state.json names
    ../secret/x.arrow; a .jsonl that is a FIFO: each refused by check in one line, exit 2, nothing hangs."""
    import datasets

    _refusal_kind(run)
    bomb = run.root / f"{run.name}-bomb.parquet"
    subprocess.run([sys.executable, "-c", BOMB, str(bomb)], check=True, timeout=300)
    disk = run.root / f"{run.name}-disk"
    datasets.Dataset.from_dict({"prompt": ["What is 1 + 1?"] * 4, "answer": ["2"] * 4}).save_to_disk(str(disk))
    state = json.loads((disk / "state.json").read_text())
    (run.root / "secret").mkdir(exist_ok=True)
    shutil.copy(disk / state["_data_files"][0]["filename"], run.root / "secret" / "x.arrow")
    state["_data_files"] = [{"filename": "../secret/x.arrow"}]
    (disk / "state.json").write_text(json.dumps(state))
    fifo = run.root / f"{run.name}-fifo.jsonl"
    os.mkfifo(fifo)
    met = []
    for variant, source, needle in (
        ("parquet-bomb", bomb, "too_large"),
        ("escape", disk, "../secret"),
        ("fifo", fifo, "FIFO"),
    ):
        out = run.watch([run.launch("--data.source", str(source))])
        met.append(_refused(run, out, variant, needle))
    run.injected = all(met)
    run.kind_note = "parquet-bomb+escape+fifo"


def feature_fifo(run: Run) -> None:
    """A parquet whose huggingface metadata declares an unused column as Image pointing at a FIFO: the
    feature is never decoded (the FIFO never opened); the run trains to the end, exit 0."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fifo = run.root / f"{run.name}.fifo"
    os.mkfifo(fifo)
    n = 64
    img = pa.array([{"bytes": None, "path": str(fifo)}] * n, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table(
        {"prompt": [f"Say the number {i}." for i in range(n)], "answer": [str(i) for i in range(n)], "img": img}
    )
    features = {"info": {"features": {"img": {"_type": "Image"}, "prompt": {"dtype": "string", "_type": "Value"}}}}
    path = run.root / f"{run.name}.parquet"
    pq.write_table(table.replace_schema_metadata({b"huggingface": json.dumps(features).encode()}), path)
    out = run.watch([run.launch("--data.source", str(path))])
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]}: {tail(out)}")
    run.injected = f"data {path}: {n} rows read, {n} usable" in out
    run.kind_note = "Image feature -> FIFO"


def fifo_lock(run: Run) -> None:
    """A finished run's run.lock replaced by a FIFO: --resume is refused in one line naming the rm, exit 2;
    the FIFO removed, --resume finishes."""
    out = run.watch([run.launch()])
    run.expect(run.exits[-1] == 0, f"exit {run.exits[-1]} before the lock was replaced: {tail(out)}")
    (run.dir / "run.lock").unlink()
    os.mkfifo(run.dir / "run.lock")
    run.steps += 2
    out = run.watch([run.launch("--steps", str(run.steps), resume=True)])
    run.injected = _refused(run, out, "fifo-lock", "run.lock", "FIFO")
    (run.dir / "run.lock").unlink()
    out = run.watch([run.launch("--steps", str(run.steps), resume=True)])
    run.expect(run.exits[-1] == 0, f"--resume after removing the FIFO exited {run.exits[-1]}: {tail(out)}")


def bad_rows(run: Run) -> None:
    """A .jsonl where a bad row hides at row 40 of 64: --data.bad-rows error is refused by check in one
    line naming row 40; skip trains to the end with the summary printed, exit 0."""
    rows = [{"prompt": f"Say the number {i}.", "answer": str(i)} for i in range(64)]
    path = run.root / f"{run.name}.jsonl"
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:39])
        + '{"prompt": "torn"\n'
        + "".join(json.dumps(r) + "\n" for r in rows[40:])
    )
    out = run.watch([run.launch("--data.source", str(path), "--data.bad-rows", "error")])
    refused = _refused(run, out, "error", f"{path}:40")
    shutil.rmtree(run.dir, ignore_errors=True)
    out = run.watch([run.launch("--data.source", str(path))])
    run.expect(run.exits[-1] == 0, f"--data.bad-rows skip: exit {run.exits[-1]}: {tail(out)}")
    run.injected = refused and "64 rows read, 63 usable, 1 bad: invalid_json 1 (first row 40)" in out


INPUTS = {
    "resume-code": resume_code,
    "reward-hack": reward_hack,
    "env-hostile": env_hostile,
    "yaml-bomb": yaml_bomb,
    "template-bomb": template_bomb,
    "index-escape": index_escape,
    "data-bomb": data_bomb,
    "feature-fifo": feature_fifo,
    "fifo-lock": fifo_lock,
    "bad-rows": bad_rows,
}
