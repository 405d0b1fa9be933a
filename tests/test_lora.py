"""LoRA (--lora.*): only the adapters train, are checkpointed and resume exactly; what the rollout
engines get (the adapted projections' merged weights, nothing else) equals the LoRA forward; the
export is a merged Hugging Face folder transformers loads and a PEFT adapter peft loads, both with
the LoRA model's logits; two FSDP2 ranks equal one; the memory plan and the pull benchmark; a
2-step torchrun run that checkpoints adapters only and resumes.

The two-rank test launches this file itself under `torchrun --nproc_per_node=2` (see `_worker`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import assert_same, random_batch, tiny_model  # noqa: E402

from staleflow.config import ConfigError, LoraConfig, TrainConfig  # noqa: E402
from staleflow.model import PackedAttention, load_model, save_hf  # noqa: E402
from staleflow.train.export import adapter_folder, export_hf  # noqa: E402
from staleflow.train.lora import adapter_bytes, is_lora_param  # noqa: E402
from staleflow.train.trainer import Trainer  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8.0, target_modules="q_proj,v_proj,down_proj")
CFG = dict(lr=2e-2, micro_batch_tokens=40, grad_clip=0.0)
IDS = torch.tensor([1, 5, 9, 20, 7, 3, 30])


def logits(model, ids=IDS) -> torch.Tensor:
    cu = torch.tensor([0, len(ids)], dtype=torch.int32)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), PackedAttention(cu)))


def trained(steps: int = 2, lora=LORA, seed: int = 0) -> Trainer:
    t = Trainer(tiny_model(seed=seed, tied=False), TrainConfig(**CFG), lora=lora)
    for k in range(steps):
        t.step(*random_batch(seed=10 + k, groups=3))
    t.model.eval()
    return t


def test_lora_trains_only_the_adapters_from_the_base_model():
    base = tiny_model(seed=0, tied=False)
    t = Trainer(tiny_model(seed=0, tied=False), TrainConfig(**CFG), lora=LORA)
    opt = [p for g in t.optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in t.model.named_parameters()}
    assert opt and all(is_lora_param(names[id(p)]) for p in opt)  # the optimizer holds adapters only
    assert len(opt) == 2 * 3 * 2  # A and B of q, v, down in 2 layers
    torch.testing.assert_close(logits(t.model.eval()), logits(base), atol=0, rtol=0)  # B = 0: the base model
    t.model.train()
    for k in range(2):
        t.step(*random_batch(seed=10 + k, groups=3))
    after = dict(t.model.state_dict())
    for name, v in base.state_dict().items():  # every base weight frozen
        assert torch.equal(after[name], v), name
    assert (logits(t.model.eval()) - logits(base)).abs().max() > 1e-3  # and the adapters learned something
    from staleflow.model import CausalLM, ModelArgs

    moe = ModelArgs(
        architecture="qwen3_moe", vocab_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    )
    with pytest.raises(ValueError, match="names no projection"):  # experts are not adapted: nothing to put it on
        Trainer(CausalLM(moe), TrainConfig(**CFG), lora=LoraConfig(rank=2, target_modules="gate_proj"))


def test_lora_config_is_checked_in_one_line():
    for bad in (dict(rank=-1), dict(rank=8, alpha=0.0), dict(rank=8, dropout=1.0), dict(rank=8, target_modules="qkv")):
        with pytest.raises(ConfigError, match="--lora."):
            LoraConfig(**bad)
    assert LoraConfig(rank=8, alpha=16).scaling == 2.0 and not LoraConfig().enabled


def test_lora_pushes_only_the_merged_projections_the_engine_needs():
    from staleflow.rollout import BuiltinEngine, Request, SamplingParams

    t = trained()
    pushed = [n for n, _ in t.pushed()]
    assert pushed == [
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    ]
    shards = {s.name: s.local for s in t.named_shards()}
    assert list(shards) == pushed
    engine = BuiltinEngine(tiny_model(seed=0, tied=False), max_kv_tokens=512, block_size=4, max_model_len=64)
    engine.load_weights(shards, version=2, strict=False)  # what LocalWeights does with a LoRA slot
    ref = logits(t.model)
    prompt = IDS.tolist()
    out = engine.generate([Request(0, prompt, SamplingParams(temperature=0, max_new_tokens=1))])[0]
    assert out.tokens.response_ids == [int(ref[-1].argmax())]
    assert out.tokens.behaviour_logprobs[0] == pytest.approx(float(torch.log_softmax(ref[-1], -1).max()), abs=1e-5)


def test_lora_export_is_a_merged_folder_and_a_peft_adapter(tmp_path):
    t = trained()
    export_hf(t, tmp_path / "hf")
    want = logits(t.model)
    merged = load_model(str(tmp_path / "hf"))
    assert not any(is_lora_param(n) for n in merged.state_dict())
    torch.testing.assert_close(logits(merged), want, atol=1e-5, rtol=1e-5)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS[None]).logits[0], want, atol=1e-5, rtol=1e-5)
    adapter = adapter_folder(tmp_path / "hf")
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft, the test extra has it)")
    save_hf(tiny_model(seed=0, tied=False), tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS[None]).logits[0], want, atol=1e-5, rtol=1e-5)


def test_lora_checkpoint_holds_adapters_only_and_resumes_exactly(tmp_path):
    from safetensors import safe_open

    from staleflow.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    t = trained(steps=1)
    path = save_checkpoint(t, tmp_path / "ckpt")
    with safe_open(str(path / "rank_0.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k).nbytes for k in f.keys()}
    models = [k for k in stored if k.startswith("model/")]
    assert models and all(is_lora_param(k) for k in models) and len(models) == 12
    adapters = adapter_bytes(t.model)
    moments = sum(v for k, v in stored.items() if k.endswith(("/exp_avg", "/exp_avg_sq")))
    assert sum(stored[k] for k in models) == adapters and moments == 2 * adapters  # nothing of the base
    full = sum(p.numel() * 4 for p in t.model.parameters())
    print(f"LoRA checkpoint: {sum(stored.values())} tensor bytes ({adapters} of adapters) for a {full}-byte model")
    r = Trainer(tiny_model(seed=0, tied=False), TrainConfig(**CFG), lora=LORA)
    load_checkpoint(r, latest_checkpoint(tmp_path / "ckpt"))
    assert r.version == 1
    batch = random_batch(seed=11, groups=3)
    t.model.train()
    assert r.step(*batch)["loss"] == t.step(*batch)["loss"]
    assert_same(r.full_state_dict(), t.full_state_dict(), atol=0)


def test_lora_is_refused_with_an_engine_that_cannot_load_some_weights():
    from staleflow.config import RolloutConfig, RunConfig
    from staleflow.engines import engine_backend

    engine_backend(RunConfig(lora=LORA))  # builtin: fine
    with pytest.raises(ConfigError, match="--rollout.engine builtin"):
        engine_backend(RunConfig(lora=LORA, rollout=RolloutConfig(engine="vllm")))


def test_lora_plan_counts_the_frozen_base_and_trains_the_adapters_only():
    from staleflow.config import RunConfig
    from staleflow.plan.estimate import trainer_rank
    from staleflow.train.parallelize import MASTER_DTYPE

    t = trained(steps=1)
    args = t.model.args
    cfg = RunConfig(lora=LORA, train=TrainConfig(**CFG))
    plan = trainer_rank(cfg, args, 0, 1, "cpu", 0, flash=False)
    held = sum(p.numel() for p in t.model.parameters()) * MASTER_DTYPE.itemsize
    adapters = sum(p.numel() for n, p in t.model.named_parameters() if is_lora_param(n)) * MASTER_DTYPE.itemsize
    state = sum(v.nbytes for st in t.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    assert plan.items["weights"] == held and plan.items["grads"] == adapters
    assert plan.items["optimizer"] == state  # exp_avg, exp_avg_sq (and the fp32 step scalars) of the adapters


@pytest.mark.scripts_smoke
def test_lora_bench_pull_script_reports_bytes_against_the_full_pull():
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_lora_pull.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--model", "tiny-llama", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {(r["engine_dtype"], r["pull"]): r for r in out["rows"]}
    assert {"full", "lora r8 attention", "lora r8 all"} <= {p for _, p in rows}
    for dt in ("float32", "bfloat16"):
        assert 0 < rows[(dt, "lora r8 attention")]["bytes_ratio"] < rows[(dt, "lora r8 all")]["bytes_ratio"] < 1
    assert proc.stdout.startswith("# ") and "cores" in proc.stdout.splitlines()[0]


# ---- across processes ---------------------------------------------------------------------------


@pytest.mark.slow
def test_lora_two_fsdp2_ranks_match_one_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALEFLOW_TEST_OUT": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    t = trained(steps=2)
    assert_same(got["full"], t.full_state_dict(), atol=1e-5)
    merged = {s.name: s.local for s in t.named_shards()}
    for name, pieces in got["shards"].items():  # each rank's merged rows tile the full merged weight
        torch.testing.assert_close(torch.cat([p for _, p in sorted(pieces)]), merged[name], atol=1e-5, rtol=1e-5)
    assert sorted(got["shards"]) == sorted(merged)


def _worker():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = Path(os.environ["STALEFLOW_TEST_OUT"])
    t = Trainer(tiny_model(seed=0, tied=False), TrainConfig(**CFG), process_group=dist.group.WORLD, lora=LORA)
    for k in range(2):
        t.step(*random_batch(seed=10 + k, groups=3))
    mine = [(s.name, s.row_offset, s.local) for s in t.named_shards()]
    every = [None, None]
    dist.all_gather_object(every, mine)
    full = t.full_state_dict()
    if dist.get_rank() == 0:
        shards: dict = {}
        for rank_shards in every:
            for name, offset, local in rank_shards:
                shards.setdefault(name, []).append((offset, local))
        torch.save({"full": full, "shards": shards}, out / "rank0.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_lora_two_step_run_checkpoints_adapters_resumes_and_exports(tmp_path):
    from run_helpers import metrics_rows, train_tiny

    def run(*extra):
        return train_tiny(tmp_path, "lora", "--log.no-progress", *extra)

    out = run("--steps", "2", "--lora.rank", "8", "--checkpoint.every", "1")
    sizes = [line for line in out.splitlines() if "LoRA adapters and their optimizer state" in line]
    assert len(sizes) >= 2, out[-3000:]  # every checkpoint printed with its size
    folder = tmp_path / "lora"
    ckpt = folder / "checkpoints" / "step_00000002"
    assert sum(f.stat().st_size for f in ckpt.iterdir()) < 1 << 20  # adapters of a 3.3M-parameter model
    out = run("--resume", str(folder), "--steps", "3")
    rows = metrics_rows(folder)
    assert [r["step"] for r in rows if not r.get("superseded")][-1] == 2 and all(
        r["bound_violations"] == 0 for r in rows
    )
    merged = load_model(str(folder / "hf"))
    want = logits(merged, IDS * 7)
    assert (want - logits(load_model("tiny-llama"), IDS * 7)).abs().max() > 0  # trained
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft, the test extra has it)")
    transformers = pytest.importorskip("transformers")
    from staleflow.model import resolve_model_path

    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(folder / "hf-lora")).eval()
    with torch.no_grad():
        torch.testing.assert_close(model((IDS * 7)[None]).logits[0], want, atol=1e-4, rtol=1e-4)


if __name__ == "__main__":
    _worker()
