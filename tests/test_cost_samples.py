"""The cost-samples file (sim/cost_samples.py) and the refit of every hardware profile from it
(scripts/fit_cost_model.py --samples F --profile P): the reader's typed checks, the one-line error for a
bad file, the refit written where the simulator reads it, and the device check's writer on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.coordinator import cost_model as cm
from staleflow.coordinator.cost_model import CostModel, load_cost_model
from staleflow.rollout.engine import CostSample
from staleflow.sim.cost_samples import CostSamplesError, SamplesHeader, SamplesWriter, Step, read_samples

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TRUE = CostModel(k1=3e-8, k2=6e-3, k3=1.2e-4, b3=2e-3, k4=0.0, kv_capacity=1 << 20)
PREFILL = 20000.0  # tokens / s of the synthetic engine
GPUS = {"h20": "NVIDIA H20", "h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}


def synthetic(path: Path, device: str = "cuda", gpu: str | None = "NVIDIA H100 80GB HBM3", model: str = "Qwen/Qwen2.5-7B-Instruct", true: CostModel = TRUE, dtype: str = "bfloat16") -> Path:  # fmt: skip
    """What the engine records for each cell, from a known cost model: one prefill step (the first token), then
    decode steps with KV growing by one token per running sequence and step; the first decode step is warm-up
    (3x slow, which the fit drops). The last cell is staggered, as chunked prefill leaves long prompts: half of
    its sequences started decoding earlier (longer context) and finish 2 steps before the others."""
    uniform = [(1, 64), (16, 2048), (256, 64), (32, 64), (128, 512), (48, 2048)]
    seqs = [[(p + 2, 5)] * n for n, p in uniform] + [[(520, 3)] * 4 + [(515, 5)] * 4]  # (context at step 0, steps)
    cells = [(n, p, 6) for n, p in uniform] + [(8, 512, 6)]
    header = SamplesHeader(
        device=device, gpu=gpu, model=model, dtype=dtype, torch="2.x", cells=cells, max_kv_tokens=4096
    )
    w = SamplesWriter(path, header)
    for i, cell in enumerate(seqs):
        n, pre = len(cell), sum(c - 2 for c, _ in cell)
        recs = [Step(i, CostSample(n, pre, pre, pre / PREFILL))]
        recs.append(Step(i, CostSample(n, sum(c - 1 for c, _ in cell), 0, 3 * true.step_time(n, pre + n)), True))
        for j in range(max(f for _, f in cell)):
            live = [c + j for c, f in cell if f > j]
            recs.append(Step(i, CostSample(len(live), sum(live), 0, true.step_time(len(live), sum(live)))))
        w.write(recs)
    w.close()
    return path


def test_replay_recovers_each_sequences_context_and_finish_from_the_steps(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        from fit_cost_model import replay_trajectories
    finally:
        sys.path.remove(str(SCRIPTS))
    _, steps = read_samples(synthetic(tmp_path / "s.jsonl"))
    tail = [s.sample for s in steps if s.cell == 6 and s.sample.prefill_tokens == 0 and not s.warmup]
    assert [s.n_running for s in tail] == [8, 8, 8, 4, 4]
    assert replay_trajectories(tail) == [(520, 3)] * 4 + [(515, 5)] * 4
    assert replay_trajectories([CostSample(2, 10, 0, 0.1), CostSample(4, 30, 0, 0.1)]) is None  # n grew: not a run


def test_cost_samples_round_trip_typed():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        header, steps = read_samples(synthetic(Path(d) / "s.jsonl"))
    assert header.gpu == "NVIDIA H100 80GB HBM3" and header.cells[1] == (16, 2048, 6) and header.tp == 1
    assert len(steps) == 7 * 7 and sum(s.warmup for s in steps) == 7
    assert all(isinstance(s.sample, CostSample) and isinstance(s.sample.kv_tokens, int) for s in steps)


GOOD_STEP = {"cell": 0, "n_running": 2, "kv_tokens": 40, "prefill_tokens": 0, "latency_s": 0.01, "warmup": False}


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda lines: lines[1:], "the first line must be a header"),
        (lambda lines: [lines[0]], "no step lines"),
        (lambda lines: lines + [json.dumps({**GOOD_STEP, "latency_s": -1.0})], "latency_s=-1.0"),
        (lambda lines: lines + [json.dumps(GOOD_STEP).replace("0.01", "NaN")], "NaN is not a number"),
        (lambda lines: lines + [json.dumps({**GOOD_STEP, "n_running": True})], "n_running=True"),
        (lambda lines: lines + [json.dumps({**GOOD_STEP, "cell": 9})], "cell=9"),
        (lambda lines: lines + [json.dumps({**GOOD_STEP, "kv_tokens": 1})], "kv_tokens=1"),
        (lambda lines: lines + [json.dumps({**GOOD_STEP, "extra": 1})], "unknown ['extra']"),
        (lambda lines: lines + ["{not json"], "line 3"),
        (lambda lines: [lines[0].replace('"bfloat16"', '"int8"')] + lines[1:], "dtype='int8'"),
        (lambda lines: [lines[0].replace('"NVIDIA H100 80GB HBM3"', "null")] + lines[1:], "gpu (the device name)"),
    ],
)
def test_cost_samples_reader_refuses_a_bad_file_in_one_line(tmp_path, mutate, why):
    lines = synthetic(tmp_path / "s.jsonl").read_text().splitlines()[:2]
    (tmp_path / "bad.jsonl").write_text("\n".join(mutate(lines)) + "\n")
    with pytest.raises(CostSamplesError) as e:
        read_samples(tmp_path / "bad.jsonl")
    assert why in str(e.value) and "\n" not in str(e.value) and "bad.jsonl" in str(e.value)


def test_fit_cost_model_bad_file_exits_2_with_one_line(tmp_path):
    import pickle

    bad = tmp_path / "samples.jsonl"
    bad.write_bytes(pickle.dumps({"n_running": 1}))  # never unpickled: it is not a JSON line
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fit_cost_model.py"), "--samples", str(bad), "--profile", "h100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("fit_cost_model: cost samples"), proc.stderr


def _fit_main(monkeypatch, *argv) -> int:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import fit_cost_model

    monkeypatch.setattr(sys, "argv", ["fit_cost_model.py", *argv])
    return fit_cost_model.main()


@pytest.mark.parametrize("profile", ["h20", "h100", "h200", "cpu"])
def test_every_profile_is_refitted_from_its_own_samples_and_the_simulator_uses_it(tmp_path, monkeypatch, capsys, profile):  # fmt: skip
    import shutil

    from staleflow.sim.config import SimConfig
    from staleflow.sim.hardware import derive, profile_cost

    presets = tmp_path / "presets"
    shutil.copytree(cm.PRESET_DIR, presets)
    monkeypatch.setattr(cm, "PRESET_DIR", presets)
    cpu = profile == "cpu"
    samples = synthetic(tmp_path / "s.jsonl", device="cpu" if cpu else "cuda", gpu=None if cpu else GPUS[profile],
                        model="smollm2-135m" if cpu else "Qwen/Qwen2.5-7B-Instruct")  # fmt: skip
    assert _fit_main(monkeypatch, "--samples", str(samples), "--profile", profile) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    preset = "cpu-smollm2" if cpu else "qwen2.5-7b-tp1"
    written = presets / f"{preset if profile in ('h20', 'cpu') else f'{preset}-{profile}'}.json"
    assert json.loads(written.read_text()) == out  # the printed profile is the one written
    fit = out["fit"]
    assert fit["profile"] == profile and fit["samples"] == 7 * 5 and fit["r2"] > 0.999 and fit["max_rel_err"] < 0.01
    assert fit["sim_cell_max_abs_rel_err"] < 0.01  # the simulator replays every cell's measured decode time
    assert fit["prefill_tokens_per_s"] == pytest.approx(PREFILL, rel=1e-6)
    # the simulator reads the refit: decode coefficients and the measured prefill rate
    sim = profile_cost(load_cost_model(preset), "h20" if cpu else profile)
    for k in ("k1", "k2", "k3"):
        assert getattr(sim, k) == pytest.approx(getattr(TRUE, k), rel=0.03), k
    if profile in ("h100", "h200"):
        assert sim.source.startswith(f"fitted on {profile}")
    assert sim.kv_capacity == load_cost_model(preset).kv_capacity  # the preset's, not the profiled engine's
    if not cpu:
        cfg = SimConfig(cost_model=preset, hardware=profile)
        assert derive(cfg, sim).prefill_tokens_per_s == pytest.approx(PREFILL, rel=1e-6)
        other = "h200" if profile != "h200" else "h100"  # another profile keeps its spec-sheet prefill rate
        assert derive(SimConfig(cost_model=preset, hardware=other), sim).prefill_tokens_per_s != pytest.approx(PREFILL)


def test_a_profile_is_not_refitted_from_another_gpus_or_models_samples(tmp_path, monkeypatch, capsys):
    samples = synthetic(tmp_path / "s.jsonl", gpu="NVIDIA H200")
    assert _fit_main(monkeypatch, "--samples", str(samples), "--profile", "h100") == 2
    err = capsys.readouterr().err
    assert "measured on NVIDIA H200 (profile h200), not h100" in err and "--profile h200" in err
    assert _fit_main(monkeypatch, "--samples", str(samples), "--profile", "h200", "--preset", "qwen2.5-32b-tp2") == 2
    assert "whose preset is qwen2.5-7b-tp1, not qwen2.5-32b-tp2" in capsys.readouterr().err
    samples = synthetic(tmp_path / "a100.jsonl", gpu="NVIDIA A100-SXM4-80GB")
    assert _fit_main(monkeypatch, "--samples", str(samples), "--profile", "h100") == 2
    assert "none of the profiles: fit without --profile" in capsys.readouterr().err


def test_sweep_budget_stops_starting_cells_and_leaves_a_readable_file(tmp_path, monkeypatch):
    """No cell starts after --cost-budget-s (the device step's guard); the first always runs, and the file holds
    exactly the cells that ran."""
    import torch

    from staleflow.model import CausalLM, ModelArgs

    monkeypatch.syspath_prepend(str(SCRIPTS))
    import fit_cost_model

    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM(args).init_weights(std=0.02, seed=0)
    cells = [(2, 8, 3), (4, 8, 3), (2, 40, 3)]
    res = fit_cost_model.record_cost_samples(model, tmp_path / "s.jsonl", cells, model_name="toy", budget_s=1e-9)
    assert res["cells_run"] == 1 and res["cells_skipped"] == 2
    header, steps = read_samples(tmp_path / "s.jsonl")
    assert header.cells == tuple(cells) and {s.cell for s in steps} == {0} and len(steps) == res["steps"] == 4
    assert [s.warmup for s in steps] == [False, True, False, False]  # prefill step, then the first decode step


@pytest.mark.scripts_smoke  # tests/test_scripts_smoke.py's row of fit_cost_model.py
def test_device_check_writer_on_cpu_then_refit(tmp_path):
    """The device check's code path on CPU: bench_engine_shape.py --cost-samples (the tiny model's shape, random
    weights) writes the file, fit_cost_model.py refits the CPU profile from it (to --out, not the preset)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    samples, fitted = tmp_path / "cost_samples.jsonl", tmp_path / "cpu-tiny-llama.json"
    bench = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_engine_shape.py"), "--model", "tiny-llama", "--device", "cpu",
         "--configs", "mirror", "--batch", "2", "--prompt", "8", "--new-tokens", "2", "--cost-samples", str(samples),
         "--cost-cells", "1x8,8x8,2x96", "--cost-decode-steps", "4"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    res = json.loads(bench.stdout.strip().splitlines()[-1])["cost_samples"]
    assert res["cells_run"] == 3 and res["cells_skipped"] == 0
    header, steps = read_samples(samples)
    assert header.device == "cpu" and header.model == "tiny-llama" and header.weights == "random"
    assert res["steps"] == len(steps) and {s.cell for s in steps} == {0, 1, 2}
    assert [sum(1 for s in steps if s.cell == c and s.sample.prefill_tokens == 0) for c in range(3)] == [4, 4, 4]
    assert max(s.sample.kv_tokens for s in steps if s.cell == 2) == 2 * (96 + 4)  # KV attended: prompt + tokens
    fit = subprocess.run(
        [sys.executable, str(SCRIPTS / "fit_cost_model.py"), "--samples", str(samples), "--profile", "cpu",
         "--out", str(fitted)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-2000:]
    model = load_cost_model(str(fitted))
    out = json.loads(fit.stdout.strip().splitlines()[-1])
    assert model.name == "cpu-tiny-llama" and out["fit"]["samples"] == 9 and "sim_cell_mean_abs_rel_err" in out["fit"]
    assert "simulator vs measured decode time per cell" in fit.stdout


def test_the_device_step_records_samples_without_msgspec_tyro_or_zmq():
    """Step 8 runs on the device image, which lacks msgspec, tyro and pyzmq unless the prepared wheels came along:
    the recording side of fit_cost_model.py (what bench_engine_shape.py imports) must not need them."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('msgspec', 'tyro', 'zmq'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"sys.path.insert(0, {str(SCRIPTS)!r})\n"
        "from fit_cost_model import kv_tokens_needed, parse_cells, record_cost_samples\n"
        "import staleflow.rollout.builtin_engine, staleflow.metrics.hardware\n"
        "print('staleflow.coordinator' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
