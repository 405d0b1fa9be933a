"""Memory plan (staleflow.plan): its bytes equal what the runtime allocates, built on the meta device.

FSDP2 shards and AdamW state come from the trainer's own ``shard_policy`` under a fake process
group (a subprocess: this file run as a script), the slot pieces from a ParameterServer whose
CUDA IPC is replaced by CPU tensors, the KV cache from a real BuiltinEngine. A dtype changed in
the runtime changes the plan. No GPU needed.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import uuid

import pytest
import torch

from staleflow.config import RolloutConfig, RunConfig, TrainConfig
from staleflow.model.args import ModelArgs
from staleflow.plan import at_start, build_plan
from staleflow.plan.estimate import layer_saved_bytes, rollout_rank, trainer_rank
from staleflow.presets import preset_gpu_7b

ARGS = ModelArgs(
    architecture="qwen2",
    vocab_size=1001,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)  # 1001 rows: FSDP2 pads shards
GiB = 2**30


def _cfg(**train) -> RunConfig:
    return RunConfig(
        rollout=RolloutConfig(max_kv_tokens=4096, max_model_len=256, block_size=16),
        train=TrainConfig(micro_batch_tokens=512, **train),
    )


def _probe(world: int) -> list[dict]:
    """Per rank: bytes of the FSDP2 shards, the AdamW state and the sharded bf16 reference, as the
    trainer's shard_policy builds them on meta tensors (fake process group, one rank at a time)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from staleflow.model.transformer import CausalLM
    from staleflow.train.parallelize import MASTER_DTYPE, compute_dtype, shard_policy
    from staleflow.train.trainer import PolicyHead

    out = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        counts = {}
        for what, dtype in (("weights", MASTER_DTYPE), ("reference", compute_dtype("cuda"))):
            with torch.device("meta"):
                policy = PolicyHead(CausalLM(ARGS).to(dtype))
            shard_policy(policy, mesh, "cuda")  # the trainer's own FSDP2 wrapping, bf16 compute policy
            counts[what] = sum(p.to_local().untyped_storage().nbytes() for p in policy.parameters())
            if what == "weights":
                opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, foreach=True)
                for p in policy.parameters():
                    p.grad = torch.zeros_like(p)
                opt.step()
                counts["optimizer"] = sum(
                    (v.to_local() if hasattr(v, "to_local") else v).nbytes
                    for st in opt.state.values()
                    for v in st.values()
                    if torch.is_tensor(v)
                )
        out.append(counts)
        dist.destroy_process_group()
    return out


def test_plan_trainer_bytes_equal_fsdp2_shards_and_adamw_state_on_meta():
    world = 4
    proc = subprocess.run([sys.executable, __file__, str(world)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = _cfg(kl_coef=0.1)
    for rank in range(world):
        plan = trainer_rank(cfg, ARGS, rank, world, "cuda", 0, flash=False)
        assert plan.items["weights"] == real[rank]["weights"], rank  # padded to ceil(rows / world)
        assert plan.items["grads"] == real[rank]["weights"]
        assert plan.items["optimizer"] == real[rank]["optimizer"], rank  # unpadded local shards + steps
        assert plan.items["reference"] == real[rank]["reference"], rank
    assert real[0]["optimizer"] != real[3]["optimizer"]  # the last rank holds fewer rows: per-rank counts


def test_plan_slot_pieces_equal_the_parameter_servers_allocations(monkeypatch):
    import staleflow.servers.pieces as pieces
    from staleflow.cluster.placement import slot_dtype, slot_placement
    from staleflow.cluster.roles import Roles
    from staleflow.cluster.topology import Topology
    from staleflow.plan.architecture import meta_model
    from staleflow.servers import ParameterServer, ParamLayout

    allocated: dict[str, int] = {}

    def create(name, nbytes, device, readers):
        allocated[name] = nbytes
        return torch.zeros(max(nbytes, 1), dtype=torch.uint8), [b"h"] * readers, "GPU-fake"

    monkeypatch.setattr(pieces, "cuda_piece_create", create)
    monkeypatch.setattr(pieces, "cuda_piece_release", lambda name: None)
    cfg = dataclasses.replace(preset_gpu_7b(), model=dataclasses.replace(preset_gpu_7b().model, path="tiny-qwen2"))
    plan = build_plan(cfg, nproc=8, gpu_bytes=80 * GiB)
    # the trainer worker's own steps: layout of the fp32 model in the slot dtype, pieces placed per rank
    from staleflow.plan.architecture import model_args

    master = meta_model(model_args("tiny-qwen2"), torch.float32)
    layout = ParamLayout.from_named_tensors(master.named_parameters(), dtype=slot_dtype(cfg, "cuda"))
    place = slot_placement(Topology.single_node(Roles(8, 4)), "cuda")
    run = "pl" + uuid.uuid4().hex[:8]
    servers = [ParameterServer.create(run, layout, device="cuda:0", pieces=place.pieces, readers=place.readers)]
    servers += [ParameterServer.attach(run, piece=r, device=f"cuda:{r}") for r in range(1, 4)]
    try:
        for r in range(4):
            real = sum(n for name, n in allocated.items() if name.endswith(f"-{r}"))
            assert plan.ranks[r].items["slots"] == real > 0
        assert slot_dtype(cfg, "cuda") == torch.bfloat16 and layout.entries[0].dtype == "bfloat16"
    finally:
        for ps in reversed(servers):
            ps.close()


def test_plan_kv_cache_equals_a_real_engine_cache():
    from staleflow.model import load_model
    from staleflow.plan.architecture import model_args
    from staleflow.rollout.builtin_engine import BuiltinEngine

    cfg = dataclasses.replace(_cfg(), model=dataclasses.replace(RunConfig().model, path="tiny-llama"))
    rc = cfg.rollout
    engine = BuiltinEngine(
        load_model("tiny-llama"),
        max_running=rc.max_running,
        max_kv_tokens=rc.max_kv_tokens,
        block_size=rc.block_size,
        prefill_chunk_tokens=rc.prefill_chunk_tokens,
        max_model_len=rc.max_model_len,
    )
    plan = rollout_rank(cfg, model_args("tiny-llama"), 1, "cpu")
    assert plan.items["kv_cache"] == engine.runner.attn.k_cache.nbytes + engine.runner.attn.v_cache.nbytes
    assert plan.items["weights"] == sum(p.nbytes for p in engine.model.parameters())


def test_a_dtype_changed_in_the_runtime_changes_the_plan(monkeypatch):
    import staleflow.train.parallelize as parallelize

    cfg = dataclasses.replace(preset_gpu_7b(), model=dataclasses.replace(preset_gpu_7b().model, path="tiny-qwen2"))
    base = build_plan(cfg, nproc=8, gpu_bytes=80 * GiB)
    fp32_slots = build_plan(
        dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, dtype="float32")), nproc=8, gpu_bytes=80 * GiB
    )
    assert fp32_slots.ranks[0].items["slots"] == pytest.approx(2 * base.ranks[0].items["slots"], rel=0.05)
    assert fp32_slots.ranks[4].items["kv_cache"] == 2 * base.ranks[4].items["kv_cache"]
    cpu = RunConfig(model=cfg.model, train=TrainConfig(kl_coef=0.1))
    bf16 = RunConfig(model=cfg.model, train=TrainConfig(kl_coef=0.1, compute_dtype="bfloat16"))
    fp32_ref = build_plan(cpu, nproc=3, gpu_bytes=0, device_type="cpu").ranks[0].items["reference"]
    assert build_plan(bf16, nproc=3, gpu_bytes=0, device_type="cpu").ranks[0].items["reference"] == fp32_ref // 2
    monkeypatch.setattr(parallelize, "MASTER_DTYPE", torch.float64)  # the trainer's master dtype
    wide = build_plan(cfg, nproc=8, gpu_bytes=80 * GiB)
    assert wide.ranks[0].items["weights"] == 2 * base.ranks[0].items["weights"]
    assert wide.ranks[0].items["optimizer"] > 1.9 * base.ranks[0].items["optimizer"]


def test_plan_activations_follow_checkpointing_and_tokens():
    one = layer_saved_bytes(ARGS, 256, torch.bfloat16, expand_kv=True)
    assert layer_saved_bytes(ARGS, 512, torch.bfloat16, expand_kv=True) == pytest.approx(2 * one, rel=0.02)
    assert layer_saved_bytes(ARGS, 256, torch.bfloat16, expand_kv=False) < one  # GQA kept unexpanded
    on = trainer_rank(_cfg(activation_checkpointing="on"), ARGS, 0, 2, "cuda", 0, flash=False)
    off = trainer_rank(_cfg(activation_checkpointing="off"), ARGS, 0, 2, "cuda", 0, flash=False)
    auto = trainer_rank(_cfg(), ARGS, 0, 2, "cuda", 0, flash=False)
    assert auto.items["activations"] == on.items["activations"] < off.items["activations"]


def test_plan_qwen_7b_on_8_x_80gb_fits_and_a_small_gpu_is_refused_with_the_flag(capsys):
    from staleflow.plan.cli import main

    code = main(["--preset", "gpu-7b", "--gpu-memory-gib", "80"])
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert code == 0 and last["fits"] is True and last["max_gpu_gib"] <= 80
    assert last["trainer_ranks"] == 4 and last["rollout_ranks"] == 4 and last["kv_cache_gib"] > 40
    assert any(line.split()[:3] == ["0", "trainer", "0"] for line in out)  # the per-rank table
    assert main(["--preset", "gpu-7b", "--gpu-memory-gib", "48"]) == 1
    captured = capsys.readouterr()
    assert "--rollout.max-kv-tokens" in captured.err and json.loads(captured.out.splitlines()[-1])["fits"] is False


def test_plan_prints_at_start_and_refuses_a_run_that_cannot_fit_on_cuda(monkeypatch, capsys):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=24 * GiB))
    refusal = at_start(preset_gpu_7b(), world_size=8)
    err = capsys.readouterr().err
    assert "memory plan: Qwen/Qwen2.5-7B-Instruct" in err and '"fits": false' in err
    assert refusal.startswith("memory plan: GPU") and "--" in refusal and "\n" not in refusal
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * GiB))
    assert at_start(preset_gpu_7b(), world_size=8) == ""


if __name__ == "__main__":
    print(json.dumps(_probe(int(sys.argv[1]))))
