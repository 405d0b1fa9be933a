"""Small simulator configs shared by the simulator tests (holds no tests itself).

``sim_config(**kw)``: 4 GPUs (3 rollout), Qwen2.5-7B's cost model, B 3 x N 2, short lognormal
responses, the hardware-derived transfer and training times, one token per decode step (no speculative
decoding: the tests that need it say so). ``tiny_sim(**kw)``: the same with
fixed fast transfers, training throughput and prefill, and no router fit (the fastest runs).
"""

from __future__ import annotations

from staleflow.config import StalenessConfig
from staleflow.sim.config import SimConfig

BASE = dict(
    total_gpus=4,
    rollout_gpus=3,
    gpus_per_instance=1,
    cost_model="qwen2.5-7b-tp1",
    max_running=16,
    train_overhead_s=0.1,
    staleness=StalenessConfig(batch_size=3, group_size=2),
    prompt_len=20,
    response_median=40.0,
    response_sigma=1.0,
    max_response=300,
    steps=6,
    warmup_steps=1,
    tick_s=0.05,
    out_dir="",
    ablation=False,
    spec_accept=1.0,
)
FAST = dict(
    prefill_tokens_per_s=5000.0,
    train_tokens_per_gpu_s=2000.0,
    push_s=0.2,
    pull_s=0.2,
    broadcast_s=0.3,
    colocated_switch_s=0.2,
    router_fit_samples=0,
    steps=8,
)


def sim_config(**kw) -> SimConfig:
    return SimConfig(**{**BASE, **kw})


def tiny_sim(**kw) -> SimConfig:
    return SimConfig(**{**BASE, **FAST, **kw})
