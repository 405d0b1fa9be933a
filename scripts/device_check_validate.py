"""Validate, without a GPU, what one step of scripts/device_check.sh will build on the device.

    python scripts/device_check_validate.py NAME -- CMD [ARGS...]     # the step's exact command

``device_check.sh --dry-run`` calls this for every step with the command the CUDA run would execute,
so a configuration the device would refuse fails here, in CI, instead of in the one device try:
- a script of ours that builds configurations (device_check_steps.py, bench_engine_shape.py,
  bench_trainer_shape.py) is run with the same arguments plus ``--validate --device cuda``: it
  resolves every configuration through the checks its CUDA run applies (e.g. ``check_cuda_graphs``
  for each engine configuration) and builds nothing;
- a pytest step is collected (``--collect-only``): an import error or an empty selection fails;
- scripts/bench_kernels.py: its shapes parse and every name in ``--skip`` is one of its impls;
- ``staleflow train`` flags (the torchrun step) are checked by device_check.sh itself with
  ``python -m staleflow check``, the check launch.sh runs.
Prints one line ``validated NAME: ...`` or ``INVALID NAME: <reason>``; exit 0 or 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VALIDATING = {"device_check_steps.py", "bench_engine_shape.py", "bench_trainer_shape.py"}


def _script(cmd: list[str]) -> str | None:
    return next((Path(a).name for a in cmd if a.endswith(".py")), None)


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ})


def validate_script(cmd: list[str]) -> tuple[bool, str]:
    """Our scripts: the same command with --validate (for the CUDA device)."""
    args = list(cmd) + ["--validate"]
    if "--device" not in args:
        args += ["--device", "cuda"]
    proc = _run(args)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    try:
        res = json.loads(lines[-1]) if lines else {}
    except ValueError:
        res = {}
    if proc.returncode != 0 or not res.get("ok"):
        why = "; ".join(res.get("errors", [])) or (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return False, why
    return True, f"{len(res.get('validated', []))} configuration(s): {', '.join(res.get('validated', []))}"


def validate_pytest(cmd: list[str]) -> tuple[bool, str]:
    """A pytest step: its files collect (imports work) and select at least one test."""
    i = cmd.index("pytest")
    files = [a for a in cmd[i + 1 :] if not a.startswith("-") and a not in ("no:cacheprovider",)]
    proc = _run([*cmd[: i + 1], "--collect-only", "-q", "-p", "no:cacheprovider", *files])
    m = re.search(r"(\d+) tests? collected", proc.stdout)
    if proc.returncode != 0 or not m:
        return False, (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or ["no output"])[-1]
    return True, f"{m.group(1)} tests collected from {', '.join(files)}"


def validate_bench_kernels(cmd: list[str]) -> tuple[bool, str]:
    """bench_kernels.py: shapes TxHxV parse, every --skip name is an impl it has."""
    shapes, skip = "", ""
    for j, a in enumerate(cmd):
        if a == "--shapes":
            shapes = cmd[j + 1]
        if a == "--skip":
            skip = cmd[j + 1]
    try:
        dims = [tuple(int(x) for x in s.split("x")) for s in shapes.split(",") if s]
    except ValueError:
        return False, f"--shapes {shapes!r}: expected TxHxV,..."
    if not dims or any(len(d) != 3 for d in dims):
        return False, f"--shapes {shapes!r}: expected TxHxV,..."
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_kernels

    known = set(bench_kernels._impls()) | {"chunked-train"}  # chunked-train: optional import there
    bad = [s for s in skip.split(",") if s and s not in known]
    if bad:
        return False, f"--skip {','.join(bad)}: not an impl of bench_kernels.py ({', '.join(sorted(known))})"
    left = sorted(known - set(skip.split(",")))
    return True, f"{len(dims)} shape(s) x impls {', '.join(left)}"


def validate(name: str, cmd: list[str]) -> tuple[bool, str]:
    script = _script(cmd)
    if "pytest" in cmd:
        return validate_pytest(cmd)
    if script in VALIDATING:
        return validate_script(cmd)
    if script == "bench_kernels.py":
        return validate_bench_kernels(cmd)
    return False, f"no validator for the command of step {name} ({' '.join(cmd)[:120]}): add one here"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the step's name")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- and the step's exact command")
    args = ap.parse_args()
    name, cmd = args.name, args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("device_check_validate: no command given after --", file=sys.stderr)
        return 2
    try:
        ok, text = validate(name, cmd)
    except Exception as e:  # a validator that cannot run is a failed validation, said in one line
        ok, text = False, f"{type(e).__name__}: {str(e)[:300]}"
    print(f"{'validated' if ok else 'INVALID'} {name}: {text}", flush=True)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
