"""How long ``python -m staleflow check`` (what ./launch.sh runs before anything starts) takes, against
the imports it cannot avoid, measured in the same run.

    python scripts/bench_check_startup.py [--reps 5] [--preset smollm2-cpu] [--baseline REV]

Each command runs --reps times in a fresh interpreter (alternating, so load drifts hit all alike);
the table shows the median and best wall seconds:
  python -c pass                          the interpreter alone
  import torch                            the floor of anything that touches a tensor
  torch + the model's tokenizer           the floor of check: it renders the first prompts with the
                                          model's tokenizer and chat template (transformers' AutoTokenizer)
  ... + import torch._dynamo              the old path: building the model on the meta device imported
                                          torch._dynamo (nn.init.normal_'s meta kernel), 2-6 s
  staleflow check --preset P              the command itself (default preset: smollm2-cpu)
  check at REV (--baseline)               the same command from another commit's src/ (git archive into a
                                          temporary folder, first on PYTHONPATH): e.g. the one before a change
and the ratios of check to the floor and to the old path. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = "import sys, torch; from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(sys.argv[1])"
PROBE = (
    "import sys, time; t = time.perf_counter()\n"
    "from staleflow.cli import main\n"
    "try:\n    main(['check', *sys.argv[1:]])\nexcept SystemExit as e:\n    code = e.code\n"
    "print('probe', code, 'torch._dynamo' in sys.modules, file=sys.stderr)\n"
)


def _run(cmd: list[str], pythonpath: str = "") -> tuple[float, str]:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    dt = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"bench_check_startup: {' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()[-500:]}")
    return dt, out.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--preset", default="smollm2-cpu")
    ap.add_argument("--baseline", default="", help="git revision whose check to time as well (e.g. HEAD~3)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-check-")
    try:
        return _bench(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _export(rev: str, tmp: str) -> str:
    """src/ and kernels/ of ``rev`` in ``tmp``: the folder to put first on PYTHONPATH."""
    archive = subprocess.run(["git", "archive", rev, "src", "kernels"], cwd=ROOT, capture_output=True, timeout=120)
    if archive.returncode != 0:
        raise SystemExit(f"bench_check_startup: --baseline {rev!r}: {archive.stderr.decode().strip()[-300:]}")
    subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True, timeout=120)
    return os.path.join(tmp, "src")


def _bench(args, tmp: str) -> int:
    from staleflow.config.parse import split_preset
    from staleflow.model.loader import resolve_model_path
    from staleflow.presets import PRESETS

    cfg, _ = split_preset(["--preset", args.preset], PRESETS, "smollm2-cpu")
    folder = resolve_model_path(cfg.model.path)
    py = sys.executable
    commands = {
        "python -c pass": [py, "-c", "pass"],
        "import torch": [py, "-c", "import torch"],
        "torch + the model's tokenizer": [py, "-c", TOKENIZER, folder],
        "... + import torch._dynamo (old path)": [py, "-c", TOKENIZER + "; import torch._dynamo", folder],
        f"staleflow check --preset {args.preset}": [py, "-c", PROBE, "--preset", args.preset],
    }
    paths = {name: "" for name in commands}
    if args.baseline:
        name = f"staleflow check at {args.baseline}"
        commands[name], paths[name] = commands[f"staleflow check --preset {args.preset}"], _export(args.baseline, tmp)
    times: dict[str, list[float]] = {k: [] for k in commands}
    dynamo = None
    _run(commands["torch + the model's tokenizer"])  # warm the page cache for every row alike
    for _ in range(args.reps):
        for name, cmd in commands.items():
            dt, err = _run(cmd, paths[name])
            times[name].append(dt)
            if name.startswith("staleflow check --preset"):
                dynamo = err.split("probe", 1)[1].split()[1] == "True"
    from staleflow.metrics.hardware import cpu_name

    load = os.getloadavg()[0]
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores, load {load:.1f}; Python {platform.python_version()}")
    print(f"{'command':<44} {'median s':>9} {'best s':>7}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, v in times.items():
        print(f"{name:<44} {med[name]:9.2f} {min(v):7.2f}")
    check = med[f"staleflow check --preset {args.preset}"]
    floor = med["torch + the model's tokenizer"]
    old = med["... + import torch._dynamo (old path)"]
    base = med.get(f"staleflow check at {args.baseline}")
    print(
        f"check / floor (torch + the tokenizer) {check / floor:.2f}x; check / old import path {check / old:.2f}x"
        + (f"; check / check at {args.baseline} {check / base:.2f}x" if base else "")
        + f"; check imports torch._dynamo: {dynamo}; under 5 s: {check < 5.0}"
    )
    print(
        json.dumps(
            {
                "check_s": round(check, 3),
                "floor_s": round(floor, 3),
                "old_path_s": round(old, 3),
                "python_s": round(med["python -c pass"], 3),
                "torch_s": round(med["import torch"], 3),
                "ratio_vs_floor": round(check / floor, 3),
                "ratio_vs_old_path": round(check / old, 3),
                "baseline": args.baseline or None,
                "baseline_s": round(base, 3) if base else None,
                "ratio_vs_baseline": round(check / base, 3) if base else None,
                "imports_dynamo": dynamo,
                "reps": args.reps,
                "preset": args.preset,
                "load_average_1min": round(load, 2),
                "cpu": cpu_name(),
                "cores": os.cpu_count(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
