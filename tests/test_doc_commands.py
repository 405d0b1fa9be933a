"""The commands README.md and docs/*.md show still work (issue 29): a renamed flag or script must
not leave a stale command behind.

Fenced code blocks: every command line (bash/sh blocks, and unlabeled blocks whose every line is a
command) must be a row of ``FENCED``: ``RUN`` (runs on CPU in well under a minute: it is run here,
in a temporary folder, and must exit 0 and end with its JSON line), or the reason it is not run
(long, or needs GPUs, nodes or a venv build); those are still parsed by the program's own parser
(argparse for scripts/, the CLI's tyro config tree for ``python -m staleflow``, torchrun's parser),
so a wrong flag fails here. Inline commands (`python scripts/...`, `python -m staleflow ...`,
`./launch.sh ...`, `bash scripts/...` in backticks) and the usage lines in the scripts' own
docstrings are parsed the same way. Bare `torchrun` mentions are torchrun's flags, not commands.

Run as a program (``python tests/test_doc_commands.py < commands.json``) it is the parse-only checker:
one process parses every command, so the heavy imports are paid once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = "run"

FENCED: dict[str, str] = {
    "python -m staleflow plan --preset gpu-7b --gpu-memory-gib 80": RUN,
    "python -m staleflow sim --preset cpu-small": RUN,
    "./launch.sh": "the main job (SmolLM2-135M, 50 steps): ~25 min on 2 cores; .ci/run runs it shortened to 2 steps",
    "bash scripts/setup_env.sh": "builds .venv (~900 MB); .ci/run runs it; tests/test_scripts_smoke.py checks it",
    ".venv/bin/python -m pytest -q tests": "the whole suite (~15 min); .ci/run runs exactly this",
    "TORCH_SPEC=torch ./launch.sh --preset gpu-7b --model.path /models/Qwen2.5-7B-Instruct --data.source "
    "/data/math.jsonl --reward.fn math --staleness.eta 2 --steps 200": "needs 8 GPUs, the model and the data file",
    "python -m staleflow.launch.torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 "
    "--master-port 29400 -m staleflow train --rollout.ranks 12 ...": "needs two 8-GPU nodes",
    ".venv/bin/python -m staleflow.launch.torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr "
    "10.0.0.1 --master-port 29400 -m staleflow train --model.path /models/Qwen2.5-7B --rollout.ranks 12 "
    "--steps 200": "needs two 8-GPU nodes and the model",
    "srun .venv/bin/python -m staleflow.launch.torchrun --nnodes '$SLURM_NNODES' --nproc-per-node 8 --rdzv-backend "
    "c10d --rdzv-endpoint '$head_ip:29400' --rdzv-id '$SLURM_JOB_ID' -m staleflow train --model.path "
    "/models/Qwen2.5-7B --rollout.ranks 12 --steps 200": "a Slurm job on two 8-GPU nodes",
    "python -m staleflow sim --preset paper-32b": "~170 s on 2 shared cores (measured 2026-12-01)",
    "python -m staleflow sim": "the paper-32b preset: ~170 s on 2 shared cores",
    "python -m staleflow sim --grid paper": "the 24-setting grid: 5-16 min on 2 cores",
    "python -m staleflow sim --eta 2 --length-dist long-cot --rollout-gpus 96 --no-ablation":
        "~90 s on 2 shared cores (measured 2026-12-01)",
    "python -m staleflow sim --total-gpus 1024 --rollout-gpus 512 --gpus-per-instance 2 --batch-size 256 --modes "
    "staleflow verl-fully-async --eta 2 --no-ablation --out-dir runs/sim-1024": "~260 s on 2 shared cores (measured)",
    "python scripts/bench_modes.py": "every mode on the real system, ~15 min; tests/test_scripts_smoke.py runs its "
                                     "smallest configuration",
    "python scripts/bench_convergence.py": "trains several runs, ~1 h on 2 cores; its smoke run is a row of "
                                           "tests/test_scripts_smoke.py",
    "python scripts/bench_engine.py": "SmolLM2-135M at batch 32, minutes; tests/test_bench_scripts.py runs it small",
}

# Inline commands that are records of runs, kept as they were written (docs/perf.md's sections are
# not rewritten); the reason says what replaced them.
INLINE_RECORDS = {
    "python scripts/fit_cost_model_cpu.py --out src/staleflow/coordinator/presets/cpu-smollm2.json":
        "docs/perf.md's 2026-11-30 record; the script is scripts/fit_cost_model.py since, with the same --out",
}
# The same for paths of scripts named in the docs (README.md, docs/*.md).
SCRIPT_PATH_RECORDS = {"scripts/fit_cost_model_cpu.py": "docs/perf.md's 2026-11-30 record (see INLINE_RECORDS)"}

_HEADS = ("python", "python3", "./launch.sh", "bash", "torchrun", "srun")
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _head(tokens: list[str]) -> int | None:
    """Index of the command word after VAR=value prefixes and `time`, or None if not a command."""
    i = 0
    while i < len(tokens) and (_ASSIGN.match(tokens[i]) or tokens[i] == "time"):
        i += 1
    if i >= len(tokens):
        return None
    word = tokens[i]
    return i if word in _HEADS or word.endswith("/bin/python") else None


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
            if not tokens or (_ASSIGN.match(tokens[0]) and _head(tokens) is None and lang):
                continue  # a shell variable assignment inside a script block
            if _head(tokens) is None:
                if lang:
                    continue
                return []  # an unlabeled block with a non-command line: a diagram or output
            out.append((off, shlex.join(tokens)))
    return out


def fenced_commands() -> list[tuple[str, int, str]]:
    """(doc, line, command) for every command line in a fenced block of README.md and docs/*.md."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in _FENCE.finditer(text):
            lang = m.group(1).strip()
            if lang not in ("", "bash", "sh", "shell", "console"):
                continue
            first = text[: m.start(2)].count("\n") + 1
            found += [(str(doc.relative_to(ROOT)), first + off, cmd) for off, cmd in _commands_in_block(m.group(2), lang)]
    return found


def inline_commands() -> list[tuple[str, str]]:
    """(where, command): backticked commands in the docs and usage lines in the scripts' docstrings."""
    found = []
    for doc in DOCS:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            tokens = _split(span)
            i = _head(tokens) if tokens else None
            if i is not None and tokens[i] not in ("torchrun", "srun"):
                found.append((str(doc.relative_to(ROOT)), shlex.join(tokens)))
    for script in sorted((ROOT / "scripts").iterdir()):
        for line in _usage_text(script).splitlines():
            tokens = _split(re.sub(r"[\[\]]", "", line.strip()))  # [--optional flags]: shown as given
            i = _head(tokens) if tokens else None
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


def parse_only(commands: list[str]) -> list[dict]:
    """Check each command with its program's own parser, in a subprocess (this file as a program)."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], input=json.dumps(commands),
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_doc_commands_fenced_are_all_listed():
    found = fenced_commands()
    unlisted = [f"{doc}:{line}: {cmd}" for doc, line, cmd in found if cmd not in FENCED]
    assert unlisted == [], ("commands in the docs' code blocks without a row in tests/test_doc_commands.py FENCED "
                            "(RUN, or why it cannot run here):\n" + "\n".join(unlisted))
    stale = sorted(set(FENCED) - {cmd for _, _, cmd in found})
    assert stale == [], f"FENCED rows no longer in any doc: {stale}"
    assert all(v == RUN or len(v) > 10 for v in FENCED.values())


def test_doc_commands_run_on_cpu(tmp_path):
    """The cheap ones run for real (from an empty folder, so they write nothing into the checkout)."""
    for cmd in [c for c, how in FENCED.items() if how == RUN]:
        argv = shlex.split(cmd)
        assert argv[0] == "python", cmd
        proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-1000:]}\n{proc.stderr[-2000:]}"
        last = proc.stdout.strip().splitlines()[-1]
        assert isinstance(json.loads(last), dict), f"{cmd}: last line is not its JSON result: {last[:200]}"


def test_doc_commands_parse():
    """Every documented command that is not run is at least accepted by its program's parser."""
    fenced = sorted(c for c, how in FENCED.items() if how != RUN)
    inline = sorted({c for _, c in inline_commands() if c not in INLINE_RECORDS})
    results = parse_only(fenced + inline)
    where = {}
    for w, c in inline_commands():
        where.setdefault(c, w)
    bad = [f"{where.get(r['cmd'], 'FENCED')}: {r['cmd']}\n    -> {r['error']}" for r in results if not r["ok"]]
    assert bad == [], "documented commands their program rejects:\n" + "\n".join(bad)
    assert len(results) == len(fenced) + len(inline)


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
    wrong = ["python scripts/bench_protocol.py --grops 10", "python -m staleflow sim --etaa 2",
             "./launch.sh --steps-typo 3", "python -m staleflow plan --preset gpu-7b --gpu-memory 80",
             "python -m staleflow.launch.torchrun --nnodez 2 -m staleflow train",
             "python -m staleflow.launch.torchrun --nnodes 2 -m staleflow train --rollout.rankz 1",
             "bash scripts/no_such_script.sh", "python scripts/no_such_script.py"]
    results = parse_only(wrong)
    assert [r["ok"] for r in results] == [False] * len(wrong), results


# ---- the parse-only checker (runs in its own process: python tests/test_doc_commands.py < commands.json) ----

_VARS = {"SLURM_NNODES": "2", "head_ip": "10.0.0.1", "SLURM_JOB_ID": "1"}


class _Parsed(Exception):
    pass


def _expand(tok: str) -> str:
    def sub(m):
        if m.group(1) not in _VARS:
            raise ValueError(f"unknown shell variable ${m.group(1)} (add it to _VARS)")
        return _VARS[m.group(1)]
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", sub, tok)


def _parse_script(path: str, args: list[str]) -> None:
    """Run scripts/X.py up to its argparse parse_args, which returns (or exits 2 on a bad flag)."""
    import argparse
    import contextlib
    import io
    import runpy

    if not (ROOT / path).is_file():
        raise ValueError(f"{path} does not exist")
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    saved_argv, saved_path, err = sys.argv, list(sys.path), io.StringIO()
    sys.argv = [str(ROOT / path), *args]
    sys.path.insert(0, str((ROOT / path).parent))  # as `python scripts/X.py` does: its siblings import
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(ROOT / path), run_name="__main__")
        raise ValueError("the script ran to the end without parsing arguments")
    except _Parsed:
        return
    except SystemExit as e:
        if e.code not in (0, None):
            raise ValueError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}")
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path


def _parse_staleflow(sub: str, args: list[str]) -> None:
    """The CLI's own parse path for a subcommand (tyro config tree + validation), nothing run."""
    import contextlib
    import io

    from staleflow.cli import parse
    from staleflow.config import RunConfig, resolve

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if sub in ("train", "check"):
                from staleflow.presets import PRESETS

                resolve(parse(RunConfig, args, PRESETS, default="smollm2-cpu", prog="staleflow train"))
            elif sub == "plan":
                from staleflow.plan.cli import take_flags
                from staleflow.presets import PRESETS

                _, rest = take_flags(args)
                resolve(parse(RunConfig, rest, PRESETS, default="smollm2-cpu", prog="staleflow plan"))
            elif sub == "sim":
                from staleflow.sim.config import PRESETS as SIM_PRESETS
                from staleflow.sim.config import SimConfig

                parse(SimConfig, args, SIM_PRESETS, default="paper-32b", prog="staleflow sim")
            else:
                raise ValueError(f"unknown subcommand {sub!r}")
    except SystemExit as e:
        if e.code not in (0, None):
            text = " ".join(re.sub(r"[│╭╰╮╯─]+|-{3,}", " ", err.getvalue()).split())
            at = min([i for i in (text.find(k) for k in ("Unrecognized", "Invalid", "Error", "error")) if i >= 0] or [0])
            raise ValueError(text[at:at + 300] or f"exit {e.code}") from None


def _parse_torchrun(args: list[str]) -> None:
    import contextlib
    import io

    from torch.distributed.run import get_args_parser

    if not any(not a.startswith("-") for a in args):
        args = [*args, "script.py"]  # torchrun's flags alone: any script
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = get_args_parser().parse_args(args)
    except SystemExit as e:
        raise ValueError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}") from None
    if ns.module and ns.training_script == "staleflow":
        _parse_staleflow(ns.training_script_args[0], ns.training_script_args[1:])


def check_command(cmd: str) -> None:
    tokens = [_expand(t) for t in shlex.split(cmd) if t != "..."]
    i = _head(tokens)
    if i is None:
        raise ValueError("not a command this checker knows")
    tokens = tokens[i:]
    if tokens[0] == "srun":
        tokens = tokens[1:]
    head, args = tokens[0], tokens[1:]
    if head == "./launch.sh":
        return _parse_staleflow("train", args)
    if head == "torchrun":
        return _parse_torchrun(args)
    if head == "bash":
        path = ROOT / args[0]
        if not path.is_file():
            raise ValueError(f"{args[0]} does not exist")
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if res.returncode:
            raise ValueError(res.stderr.strip())
        return None
    if args[:2] == ["-m", "staleflow"] and len(args) > 2:
        return _parse_staleflow(args[2], args[3:])
    if args[:2] == ["-m", "staleflow.launch.torchrun"]:
        return _parse_torchrun(args[2:])
    if args[:2] == ["-m", "pytest"]:
        paths = [a for a in args[2:] if not a.startswith("-")]
        missing = [p for p in paths if not (ROOT / p.split("::")[0]).exists()]
        if missing:
            raise ValueError(f"pytest paths that do not exist: {missing}")
        return None
    if args and args[0].startswith("scripts/") and args[0].endswith(".py"):
        return _parse_script(args[0], args[1:])
    raise ValueError("not a command form this checker knows")


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    results = []
    for cmd in json.loads(sys.stdin.read()):
        try:
            check_command(cmd)
            results.append({"cmd": cmd, "ok": True, "error": ""})
        except Exception as e:  # noqa: BLE001 - every failure is reported per command
            results.append({"cmd": cmd, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
