"""scripts/device_check_steps.py on CPU: the same code paths as its GPU steps (gloo instead of NCCL,
chunked vs naive log-probs instead of Triton vs chunked, shared-memory slots instead of CUDA IPC
pieces), so the prepared device check does not rot between GPU sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.scripts_smoke]  # a row of tests/test_scripts_smoke.py
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check_steps.py"


@pytest.mark.parametrize("step", ["trainer", "ps"])
def test_device_check_step_runs_on_cpu(step):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), step, "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env
    )
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and res["ok"] is True, proc.stdout[-2000:] + proc.stderr[-2000:]
    if step == "trainer":
        assert res["chunked"]["fsdp2_sharded"] and res["loss_rel_diff"] < 1e-6
    else:
        assert [p["exact"] for p in res["pulls"]] == [True] * 4 and {p["reader"] for p in res["pulls"]} == {2, 3}


def test_device_check_dry_run_lists_every_step_with_its_limit_within_six_minutes(tmp_path):
    import re
    import tarfile

    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT.parent / "device_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = re.findall(r"^step (\d+) (\w+): limit (\d+) s: (.*)$", proc.stdout, re.M)
    names = [s[1] for s in steps]
    assert names == ["env", "ps_ipc", "torchrun_2proc", "engine_gpu", "kernel_tests", "kernel_bench", "engine_7b",
                     "trainer_7b"]  # fmt: skip
    assert sum(int(s[2]) for s in steps) <= 360
    commands = {s[1]: s[3] for s in steps}
    assert "plan" not in names and "--shapes 16384x3584x152064" in commands["kernel_bench"]  # the 7B shape only
    assert sorted(p.name for p in out.iterdir()) == ["device_check.json", "device_check_logs.tar.gz"]  # <= 2 files
    summary = json.loads((out / "device_check.json").read_text())
    assert summary["dry_run"] is True and summary["limit_total_s"] == sum(int(s[2]) for s in steps)
    with tarfile.open(out / "device_check_logs.tar.gz") as tar:
        assert {Path(n).name for n in tar.getnames()} >= {f"{n}.log" for n in names}


def test_device_check_env_step_records_versions_and_out_dtype_support():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "env", "--device", "cpu"], capture_output=True, text=True, timeout=120
    )
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and res["ok"] is True, proc.stderr[-2000:]
    import torch

    assert res["torch"] == torch.__version__ and set(res["dev_shm_gib"]) == {"total", "free"}
    assert res["mm_out_dtype"] is True or res["mm_out_dtype"].startswith("no (")


def _script_json(name: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / name), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_device_check_engine_shape_bench_runs_small_on_cpu():
    res = _script_json(
        "bench_engine_shape.py", "--device", "cpu", "--hidden", "64", "--layers", "2", "--batch", "4", "--prompt", "16",
        "--new-tokens", "8",
    )  # fmt: skip
    assert res["ok"] is True and [r["backend"] for r in res["runs"]] == ["gather", "mirror"]
    assert all(r["decode_tok_s"] > 0 and r["agree_with_base"] == 1.0 for r in res["runs"])  # fp32: identical tokens
    assert res["runs"][0]["tok_s_vs_base"] == 1.0 and res["plan_gib"] > 0
    assert res["cuda_graphs"] in ("available", "unavailable") and res["runs"][0]["cuda_graphs"] == "unavailable"


def test_device_check_trainer_shape_bench_runs_small_on_cpu():
    res = _script_json(
        "bench_trainer_shape.py", "--device", "cpu", "--hidden", "64", "--layers", "2", "--micro-batch-tokens", "64",
        "--len", "16", "--samples", "8", "--steps", "2",
    )  # fmt: skip
    assert res["ok"] is True and res["tokens_per_step"] == 8 * 32 and res["tokens_per_s"] > 0
    assert res["shape"]["layers"] == 2 and res["plan_gib"] > 0 and "optim_step" in res["plan_items_gib"]
