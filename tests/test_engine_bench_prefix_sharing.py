"""scripts/bench_prefix_sharing.py runs end to end (tiny model, tiny settings) and reports the
prefill tokens it saved; timings are printed, never checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.scripts_smoke  # a row of tests/test_scripts_smoke.py


def test_bench_prefix_sharing_reports_prefill_saved_and_agreement():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_prefix_sharing.py"),
            "--model",
            "tiny-llama",
            "--groups",
            "2",
            "--group-sizes",
            "2,4",
            "--prompt-len",
            "40",
            "--new-tokens",
            "3",
            "--repeats",
            "1",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for g in (2, 4):  # 40-token prompts, block 16: 2 shared blocks, each extra member computes 8 tokens
        assert out[f"g{g}_prefill_tokens_baseline"] == 2 * g * 40
        assert out[f"g{g}_prefill_tokens"] == 2 * (40 + (g - 1) * 8)
        assert out[f"g{g}_wall_s"] > 0 and out[f"g{g}_speedup"] > 0
        assert out[f"g{g}_same_tokens"] == f"{2 * g}/{2 * g}"
