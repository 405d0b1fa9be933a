"""scripts/bench_pull.py runs (tiny model, one repetition) and reports both paths for both engine dtypes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_pull.py"
pytestmark = pytest.mark.scripts_smoke  # a row of tests/test_scripts_smoke.py


def test_bench_pull_smoke():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny-llama", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert [r["engine_dtype"] for r in rows] == ["float32", "bfloat16"]
    assert rows[1]["now_slot_mb"] < rows[1]["before_slot_mb"]  # the bf16 slot is half the fp32 one
    assert all(r["before_s"] > 0 and r["now_s"] > 0 for r in rows)
