"""vLLM rollout ranks on a GPU node, without a GPU or vLLM: a fake vLLM records what the engine is
started with (CUDA_VISIBLE_DEVICES at that moment, EngineArgs) and what its worker is asked to do.

- each vLLM rank's engine starts with its own GPU as the first (engine) device, no other rollout
  rank's GPU visible, and the parent's variable restored afterwards;
- gpu_memory_utilization comes from the memory plan, CUDA graphs are on (enforce_eager off);
- a pull goes through the worker extension with the worker's own reader index, no file.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

from staleflow.cluster.roles import Roles
from staleflow.presets import preset_gpu_7b

GiB = 2**30


@pytest.fixture
def fake_vllm(monkeypatch):
    seen = {"engines": [], "rpc": []}

    class EngineArgs:
        def __init__(self, **kw):
            self.kw = kw

        def create_engine_config(self):
            seen["config_env"] = os.environ.get("CUDA_VISIBLE_DEVICES")
            return self

    class LLMEngine:
        def __init__(self, vllm_config, executor_class, log_stats, stat_loggers, multiprocess_mode):
            seen["engines"].append({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "args": vllm_config.kw})

        def collective_rpc(self, method, args=()):
            seen["rpc"].append((method, args))
            return [7]

        def reset_prefix_cache(self):
            return True

        def abort_request(self, ids):
            pass

    mods = {
        "vllm": types.ModuleType("vllm"),
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
        "vllm.v1.engine.llm_engine": types.ModuleType("vllm.v1.engine.llm_engine"),
        "vllm.v1.executor": types.ModuleType("vllm.v1.executor"),
    }
    mods["vllm"].EngineArgs = EngineArgs
    mods["vllm.v1.engine.llm_engine"].LLMEngine = LLMEngine
    mods["vllm.v1.executor"].Executor = types.SimpleNamespace(get_class=lambda cfg: object)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return seen


def _ctx(rank: int):
    cfg = preset_gpu_7b()
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path="tiny-llama"),
        rollout=dataclasses.replace(cfg.rollout, engine="vllm"),
    )
    return types.SimpleNamespace(cfg=cfg, roles=Roles(8, 4), rank=rank, device=f"cuda:{rank}")


def test_cuda_visible_each_vllm_rank_gets_exactly_its_own_device(fake_vllm):
    from staleflow.plan import build_plan
    from staleflow.workers.rollout import build_engine

    engines = {}
    for rank in (4, 5, 6, 7):
        ctx = _ctx(rank)
        engines[rank] = build_engine(ctx, model=None)
        assert os.environ.get("CUDA_VISIBLE_DEVICES") is None  # the rank's own environment is restored
    started = fake_vllm["engines"]
    firsts = [e["visible"].split(",")[0] for e in started]
    assert firsts == ["4", "5", "6", "7"]  # vLLM's device 0 is the rank's own GPU, one rank per GPU
    for rank, e in zip((4, 5, 6, 7), started):
        visible = e["visible"].split(",")
        assert set(visible) - {str(rank)} <= {"0", "1", "2", "3"}  # besides its own: only slot-piece GPUs
        assert visible[1:] == ["0", "1", "2", "3"]  # the trainer GPUs whose pieces its worker maps
        assert e["args"]["enforce_eager"] is False  # CUDA graphs on a GPU
    plan = build_plan(_ctx(4).cfg, 8, 80 * GiB, num_gpus=8)
    assert [e["args"]["gpu_memory_utilization"] for e in started] == [plan.gpu_share[r] for r in (4, 5, 6, 7)]
    assert 0 < plan.gpu_share[4] < 1
    assert fake_vllm["config_env"] == "7,0,1,2,3"  # vLLM's config was also built under the rank's own view


def test_cuda_visible_follows_the_parents_device_list():
    from staleflow.cluster.placement import engine_visible_devices

    assert engine_visible_devices(5, [0, 1, 2, 3], 8, "8,9,10,11,12,13,14,15") == "13,8,9,10,11"
    assert engine_visible_devices(0, [0], 1) == "0"  # one GPU shared by a trainer and a rollout rank


def test_vllm_pull_goes_through_the_worker_with_its_own_reader_index(fake_vllm):
    from staleflow.cluster.placement import reader_index
    from staleflow.rollout.vllm_engine import VllmEngine

    engine = VllmEngine.from_config(_ctx(5).cfg.model, _ctx(5).cfg.rollout, model_path="tiny-llama")
    version = engine.load_from_server("run1", reader_index(5, 8, engine_worker=True))
    assert version == 7 and engine.version == 7
    assert fake_vllm["rpc"] == [("staleflow_pull_weights", ("run1", 13, 60.0))]
