"""The engine benchmark scripts still run end to end (tiny model, tiny settings) and print the
JSON their perf.md numbers come from. Timings are not checked, only that they are measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name, *args):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_engine_reports_ratios_and_the_gemm_floor():
    pytest.importorskip("transformers")
    out = run_script("bench_engine.py", "--model", "tiny-llama", "--batch", "3", "--new-tokens", "5",
                     "--prompt-len", "6", "--repeats", "1", "--no-vllm", "--threads", "1", "--skewed", "4")
    for key in ("tok_s", "hf_tok_s", "ratio_vs_hf", "gemm_floor_tok_s", "max_ratio_vs_hf", "ratio_vs_hf_skewed"):
        assert out[key] > 0, key
    assert out["gemm_floor_tok_s"] >= out["tok_s"] * 0.5  # a floor of the same step, not some other unit


def test_bench_decode_step_compares_mirror_and_sampler_paths():
    out = run_script("bench_decode_step.py", "--model", "tiny-llama", "--batch", "3", "--contexts", "8,20",
                     "--steps", "2")
    assert set(out) == {"mirror_speedup_ctx8", "mirror_speedup_ctx20", "sample_speedup", "top_p_speedup"}
    assert all(v > 0 for v in out.values())
