"""Rank set-up from torchrun's environment: identity, device choice and device setting (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from staleflow.config import ConfigError
from staleflow.launch import dist


def test_device_is_cuda_local_rank_when_gpus_exist():
    env = dist.read_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 4, 1)
    assert dist.pick_device(env.local_rank, cuda_count=4) == "cuda:1"
    assert [dist.pick_device(r, cuda_count=8) for r in range(8)] == [f"cuda:{r}" for r in range(8)]


def test_device_is_cpu_without_gpus_and_shared_when_ranks_outnumber_gpus():
    assert dist.pick_device(3, cuda_count=0) == "cpu"
    assert [dist.pick_device(r, cuda_count=1) for r in range(2)] == ["cuda:0", "cuda:0"]  # 1 trainer + 1 rollout


def test_device_selection_with_a_mocked_device_count(monkeypatch):
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_to.append(d))
    env = dist.read_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    device = dist.pick_device(env.local_rank)
    dist.set_device(device)
    assert device == "cuda:3" and set_to == ["cuda:3"]
    dist.set_device("cpu")
    assert set_to == ["cuda:3"]


def test_device_env_outside_torchrun_is_a_config_error():
    with pytest.raises(ConfigError, match="must run under torchrun"):
        dist.read_env({})
    assert dist.read_env({"RANK": "0", "WORLD_SIZE": "1"}).node_rank == 0
