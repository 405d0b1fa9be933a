"""The checker behind tests/test_doc_commands.py, run as its own process so the heavy imports
(torch, transformers, tyro) are paid once for every documented command:

    python tests/doc_commands_check.py < commands.json          # parse each with its program's parser
    python tests/doc_commands_check.py --run < commands.json    # run each `python -m staleflow ...`

Parsing never runs the program: scripts/X.py runs up to its argparse ``parse_args`` (which then
stops it), ``python -m staleflow SUB`` goes through the CLI's own parse path (tyro config tree and
its validation), torchrun commands through torchrun's parser and then the staleflow part. Prints one
JSON line: a list of {"cmd", "ok", "error"}.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS = ("python", "python3", "./launch.sh", "bash", "torchrun", "srun")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def command_word(tokens: list[str]) -> int | None:
    """Index of the command word after VAR=value prefixes and `time`, or None if not a command."""
    i = 0
    while i < len(tokens) and (_ASSIGN.match(tokens[i]) or tokens[i] == "time"):
        i += 1
    if i >= len(tokens):
        return None
    word = tokens[i]
    return i if word in HEADS or word.endswith("/bin/python") else None


_VARS = {"SLURM_NNODES": "2", "head_ip": "10.0.0.1", "SLURM_JOB_ID": "1", "PWD": str(ROOT)}


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
            raise ValueError(
                err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
            ) from None
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path


def _parse_staleflow(sub: str, args: list[str]) -> None:
    """The CLI's own parse path for a subcommand (tyro config tree + validation), nothing run."""
    import contextlib
    import io

    from staleflow.config import RunConfig, resolve
    from staleflow.config.parse import parse

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
            elif sub == "eval":
                import tyro

                from staleflow.eval.command import EvalCommand

                tyro.cli(EvalCommand, args=args, prog="staleflow eval")
            elif sub in ("-h", "--help") and not args:
                from staleflow.cli import main as cli_main

                cli_main([sub])  # the list of commands, exit 0
            else:
                raise ValueError(f"unknown subcommand {sub!r}")
    except SystemExit as e:
        if e.code not in (0, None):
            text = " ".join(re.sub(r"[│╭╰╮╯─]+|-{3,}", " ", err.getvalue()).split())
            found = [i for i in (text.find(k) for k in ("Unrecognized", "Invalid", "Error", "error")) if i >= 0]
            at = min(found, default=0)
            raise ValueError(text[at : at + 300] or f"exit {e.code}") from None


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
        text = err.getvalue().strip()
        raise ValueError(text.splitlines()[-1] if text else f"exit {e.code}") from None
    if ns.module and ns.training_script == "staleflow":
        _parse_staleflow(ns.training_script_args[0], ns.training_script_args[1:])


def check_command(cmd: str) -> None:
    tokens = [_expand(t) for t in shlex.split(cmd) if t != "..."]
    i = command_word(tokens)
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


def run_command(cmd: str) -> None:
    """Run ``python -m staleflow ARGS`` here (staleflow/__main__.py, that argv): exit 0 and a JSON last line."""
    import contextlib
    import io
    import runpy

    tokens = shlex.split(cmd)
    out, err, saved = io.StringIO(), io.StringIO(), sys.argv
    sys.argv, code = ["staleflow", *tokens[3:]], 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module("staleflow", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    lines = out.getvalue().strip().splitlines()
    if code != 0:
        raise ValueError(f"exit {code}: {err.getvalue().strip()[-500:]}")
    if not lines or not isinstance(json.loads(lines[-1]), dict):
        raise ValueError(f"the last line is not its JSON result: {(lines or [''])[-1][:200]}")


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    if Path.cwd() == ROOT:  # as ./launch.sh and `python -m staleflow` from the root: a fork's import path resolves
        sys.path.append(str(ROOT))  # (appended: nothing installed is shadowed by a folder of the checkout)
    check = run_command if "--run" in sys.argv[1:] else check_command
    results = []
    for cmd in json.loads(sys.stdin.read()):
        try:
            check(cmd)
            results.append({"cmd": cmd, "ok": True, "error": ""})
        except Exception as e:  # noqa: BLE001 - every failure is reported per command
            results.append({"cmd": cmd, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
