"""The engine benchmark scripts still run end to end (tiny model, tiny settings) and print the
JSON their perf.md numbers come from. Timings are not checked, only that they are measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.scripts_smoke  # tests/test_scripts_smoke.py lists these rows


def run_script(name, *args):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_engine_reports_ratios_and_the_gemm_floor():
    pytest.importorskip("transformers")
    out = run_script(
        "bench_engine.py",
        "--model",
        "tiny-llama",
        "--batch",
        "3",
        "--new-tokens",
        "5",
        "--prompt-len",
        "6",
        "--repeats",
        "1",
        "--no-vllm",
        "--threads",
        "1",
        "--skewed",
        "4",
    )
    for key in ("tok_s", "hf_tok_s", "ratio_vs_hf", "gemm_floor_tok_s", "max_ratio_vs_hf", "ratio_vs_hf_skewed"):
        assert out[key] > 0, key
    assert out["gemm_floor_tok_s"] >= out["tok_s"] * 0.5  # a floor of the same step, not some other unit


def test_bench_decode_step_compares_mirror_and_sampler_paths():
    out = run_script(
        "bench_decode_step.py", "--model", "tiny-llama", "--batch", "3", "--contexts", "8,20", "--steps", "2"
    )
    assert set(out) == {"mirror_speedup_ctx8", "mirror_speedup_ctx20", "sample_speedup", "top_p_speedup"}
    assert all(v > 0 for v in out.values())


def test_fit_cost_model_output_is_a_loadable_cost_model(tmp_path):
    """The documented workflow: fit on this machine, hand the JSON to --coordinator.cost-model."""
    from staleflow.coordinator.cost_model import load_cost_model
    from staleflow.rollout.engine import CostSample
    from staleflow.sim.cost_samples import SamplesHeader, SamplesWriter, Step

    k1, k2, k3, k4 = 2e-5, 3e-3, 4e-3, 5e-2
    cells = [(n, kv, 2) for n in (1, 4, 8, 16, 32, 48) for kv in (100, 2000, 8000)]
    samples = tmp_path / "samples.jsonl"
    header = SamplesHeader(
        device="cpu", model="tiny-llama", dtype="float32", torch="x", cells=cells, max_kv_tokens=32768
    )
    writer = SamplesWriter(samples, header)
    for i, (n, kv, _) in enumerate(cells):
        lat = k1 * kv * n + max(k2, k3 * n) + k4
        writer.write([Step(i, CostSample(n, kv * n, 0, lat))])
    writer.close()
    out = tmp_path / "fit.json"
    printed = run_script("fit_cost_model.py", "--samples", str(samples), "--out", str(out))
    model = load_cost_model(str(out))
    assert model.k1 == pytest.approx(k1, rel=0.05) and model.k3 == pytest.approx(k3, rel=0.05)
    assert printed["k1"] == model.k1 and model.kv_capacity == 32768


def test_bench_gemm_layout_times_every_layout():
    from staleflow.metrics.hardware import bf16_prepack_missing

    out = run_script("bench_gemm_layout.py", "--model", "tiny-llama", "--m", "4", "--repeats", "1")
    skipped = out.pop("skipped", {})
    want = {
        "float32:linear",
        "float32:fused mm",
        "float32:fused linear",
        "float32:oneDNN prepacked",
        "float32:MKL prepacked",
        "bfloat16:fused mm",
        "bfloat16:oneDNN prepacked",
    }
    missing = bf16_prepack_missing()  # any x86-64 CPU runs it: without AVX-512 the bf16 prepack is skipped, said why
    if missing:
        assert skipped == {"bfloat16:oneDNN prepacked": missing}
        want.discard("bfloat16:oneDNN prepacked")
    else:
        assert skipped == {}
    assert want <= set(out)
    assert out["float32:linear"] == 1.0 and all(v > 0 for v in out.values())


def test_bench_trainer_load_measures_both_paths_on_sharded_ranks():
    out = run_script("bench_trainer_load.py", "--model", "tiny-llama", "--ranks", "2")
    assert out["stored_dtype"] == "bfloat16" and out["ranks"] == 2
    assert out["shard_mib"] == pytest.approx(out["full_model_mib"] / 2, rel=0.05)  # each rank keeps half the rows
    # the baseline holds the whole fp32 model (cast from the bf16 file) at its peak: the sampler sees it
    assert out["baseline_full_peak_anon_mib"] >= out["full_model_mib"]
    assert out["lazy_vs_full_peak_anon"] > 0 and out["lazy_vs_full_vm_hwm"] > 0


def test_bench_multinode_pull_takes_each_piece_from_its_node():
    """Three layouts in one run: ``local`` copies everything on node 1, ``remote`` receives it all from
    node 0, ``sharded`` half from each node (bytes measured by the puller); ratios against the same
    run's ``local`` and ``remote``."""
    import torch

    from staleflow.model import lazy_model
    from staleflow.servers import ParamLayout

    out = run_script("bench_multinode_pull.py", "--model", "tiny-llama", "--reps", "1")
    layout = ParamLayout.from_named_tensors(lazy_model("tiny-llama")[0].named_parameters(), dtype=torch.float32)
    rows = {r["layout"]: r for r in out["rows"]}
    assert out["hardware"] and list(rows) == ["local", "remote", "sharded"]
    assert list(rows["local"]["bytes_by_node"]) == ["1"] and list(rows["remote"]["bytes_by_node"]) == ["0"]
    full = rows["local"]["bytes_by_node"]["1"]
    assert full == sum(e.nbytes for e in layout.entries)  # every parameter, once
    assert rows["remote"]["bytes_by_node"]["0"] == full
    split = rows["sharded"]["bytes_by_node"]
    assert sorted(split) == ["0", "1"] and sum(split.values()) == full and 0 < split["0"] < full
    assert rows["local"]["vs_local"] == 1.0 and rows["remote"]["vs_remote"] == 1.0
    assert all(r["seconds"] > 0 and r["gb_per_s"] > 0 for r in rows.values())
