"""What the simulator charges like real hardware: PS pulls share the PS egress, chunked prefill lets decoding
go on, training time grows with sequence length (sim/hardware.py, sim/engine.py, sim/backend.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from staleflow.coordinator.cost_model import load_cost_model
from staleflow.coordinator.types import Pull
from staleflow.sim.backend import SimBackend
from staleflow.sim.engine import SimInstance, SimSequence
from staleflow.sim.hardware import MODEL_SPECS, derive, train_attention_tokens2
from staleflow.trajectory import TrainGroup

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import tiny_sim  # noqa: E402


def backend(cfg, n=6, sync="ps"):
    cost = load_cost_model(cfg.cost_model)
    return SimBackend(cfg, derive(cfg, cost), cost, n, cfg.total_gpus - cfg.rollout_gpus, sync)


def test_pulls_in_flight_share_the_parameter_server_egress():
    # 7B weights 15.2 GB at 0.2 s = 76 GB/s per pull; 152 GB/s of egress serves two at full speed
    cfg = tiny_sim(total_gpus=8, rollout_gpus=6, ps_egress_gb_s=152.4)
    b = backend(cfg)
    assert derive(cfg, b.cost).pull_share == pytest.approx(0.5, rel=0.01)
    for i in range(6):
        b.pull(Pull(i, 1))
    ends = [inst.sync_until for inst in b.insts]
    assert ends[0] == ends[1] == pytest.approx(0.2)  # two at once: each at its own bandwidth
    assert ends[2] == pytest.approx(0.3, rel=0.01) and ends[5] == pytest.approx(0.6, rel=0.01)  # 3..6 share
    free = backend(dataclasses.replace(cfg, ps_egress_gb_s=0.0))
    for i in range(6):
        free.pull(Pull(i, 1))
    assert all(inst.sync_until == pytest.approx(0.2) for inst in free.insts)  # 0: no contention
    bc = backend(cfg, sync="broadcast")
    for i in range(6):
        bc.pull(Pull(i, 1))
    assert len({inst.sync_until for inst in bc.insts}) == 1  # a broadcast is one transfer to all


def test_chunked_prefill_keeps_decoding_while_a_new_trajectory_prefills():
    cost = load_cost_model("qwen2.5-7b-tp1")

    def one(chunk):
        inst = SimInstance(0, cost, prefill_tokens_per_s=1000.0, max_running=8, chunk_tokens=chunk)
        inst.add(SimSequence(0, 0, 10, 400))
        inst.advance(1.0)  # the first one runs alone
        made = inst.tokens_out
        inst.add(SimSequence(1, 0, 3000, 50))  # a 3 s prefill arrives
        inst.advance(3.0)
        return inst.tokens_out - made, inst

    stalled, a = one(0)
    chunked, b = one(64)  # 62 prefill tokens (62 ms) ride on each decode step
    assert stalled == 0  # the prefill held the instance for the whole 2 s
    assert chunked > 20 and b.prefill_debt > 0  # decoding went on, each step carrying a prefill chunk
    b.advance(10.0)
    a.advance(10.0)
    assert b.prefill_debt == 0 and b.busy_s == pytest.approx(a.busy_s, rel=0.05)  # the same work in total


def test_training_time_grows_with_sequence_length():
    spec = MODEL_SPECS["qwen2.5-7b-tp1"]
    assert train_attention_tokens2(spec) * 20000**2 / 20000 == pytest.approx(0.263, rel=0.01)  # +26 % at 20k
    cfg = tiny_sim(train_tokens_per_gpu_s=1000.0, train_overhead_s=0.0, train_noise=0.0)

    def train_s(lengths, cfg=cfg):
        b = backend(cfg)
        b.train(0, [TrainGroup(0, 0, [0], [], [1.0], lengths, 0)])
        return b.trainer_busy_s

    short, long = train_s([1000] * 20), train_s([20000])  # the same 20k tokens
    assert short == pytest.approx(20 * (1000 + 0.01317 * 1000) / 1000.0, rel=0.01)
    assert long / short == pytest.approx(1.263 / 1.0132, rel=0.01)
    flat = dataclasses.replace(cfg, train_attention=False)
    assert train_s([1000] * 20, flat) == pytest.approx(train_s([20000], flat)) == pytest.approx(20.0)


def test_hardware_profiles_rescale_the_h20_fit_or_use_a_preset_refitted_on_that_gpu(tmp_path, monkeypatch):
    import shutil
    import subprocess

    from staleflow.coordinator import cost_model as cm
    from staleflow.sim.hardware import profile_cost
    from staleflow.sim.simulator import build

    h20 = load_cost_model("qwen2.5-7b-tp1")
    assert profile_cost(h20, "h20") is h20
    h100 = profile_cost(h20, "h100")
    assert h100.name == h20.name and h100.k1 == pytest.approx(h20.k1 * 4.0 / 3.35)
    assert h100.k3 == pytest.approx(h20.k3 * 148 / 989) and h100.k4 == h20.k4
    # the profile's memory gives the KV capacity the instances run with: 141 GB (H200) holds more than 80 GB
    caps = {
        hw: build(tiny_sim(hardware=hw, push_s=None, pull_s=None), "staleflow", 1)[1].cost.kv_capacity
        for hw in ("h100", "h200")
    }
    assert caps["h200"] > 2 * caps["h100"]
    # scripts/fit_cost_model.py --profile refits a profile from a device run's samples; the simulator then uses it
    from staleflow.rollout.engine import CostSample
    from staleflow.sim.cost_samples import SamplesHeader, SamplesWriter, Step

    cells = [(n, kv, 2) for n in (1, 4, 16, 64) for kv in (100, 2000, 8000)]
    gpu = "NVIDIA H100 80GB HBM3"  # a profile is refitted from its own GPU's samples (the file's header)
    header = SamplesHeader(
        device="cuda", gpu=gpu, model="Qwen/Qwen2.5-7B-Instruct", dtype="bfloat16", torch="x", cells=cells
    )
    writer = SamplesWriter(tmp_path / "s.jsonl", header)
    for i, (n, kv, _) in enumerate(cells):
        writer.write([Step(i, CostSample(n, kv * n, 0, 2e-8 * kv * n + 0.004))])
    writer.close()
    presets = tmp_path / "presets"
    shutil.copytree(cm.PRESET_DIR, presets)
    script = Path(__file__).parents[1] / "scripts" / "fit_cost_model.py"
    out = presets / "qwen2.5-7b-tp1-h100.json"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--samples",
            str(tmp_path / "s.jsonl"),
            "--profile",
            "h100",
            "--preset",
            "qwen2.5-7b-tp1",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.setattr(cm, "PRESET_DIR", presets)
    fitted = profile_cost(h20, "h100")
    assert fitted.name == "qwen2.5-7b-tp1" and fitted.source.startswith("fitted on h100")
    assert fitted.k1 == pytest.approx(2e-8, rel=0.05) and fitted.k2 == pytest.approx(0.004, rel=0.05)
