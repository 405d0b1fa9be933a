"""Mixture of experts across processes: two FSDP2 gloo ranks train a Qwen3-MoE exactly like one rank
(experts a unit of their own, experts that got no token on a rank still reduce-scatter), and a real
2-step run (torchrun, 1 trainer + 2 rollout ranks + controller) trains `tiny-qwen3-moe`, reports
tokens per expert and exports a folder transformers loads with identical logits.

The two-rank test launches this file itself under `torchrun --nproc_per_node=2` (see `_worker`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import assert_same, capture_grads, lipschitz_adam, random_batch  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.model import CausalLM, ModelArgs  # noqa: E402
from staleflow.train.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.slow

# 8 experts, top-1, 15-token micro-batches: on each rank some experts get no token in a micro-batch.
# The router's auxiliary loss is a statistic of each micro-batch, and two ranks cut a step into other
# micro-batches than one rank: the exact comparison runs without it, a second trainer with it.
CFG = dict(lr=1e-2, micro_batch_tokens=15, grad_clip=0.5)
ARGS = ModelArgs(
    architecture="qwen3_moe",
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    num_experts=8,
    num_experts_per_tok=1,
    moe_intermediate_size=16,
    tie_word_embeddings=False,
)


def _model() -> CausalLM:
    return CausalLM(ARGS).init_weights(std=0.2, seed=4)


def _batches():
    return random_batch(seed=41, groups=4), random_batch(seed=42, groups=4)


def test_moe_two_fsdp2_ranks_match_one_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALEFLOW_TEST_OUT": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert got["units"] == ["lm.model.layers.0", "lm.model.layers.0.mlp.experts", "lm.model.layers.1"] + [
        "lm.model.layers.1.mlp.experts"
    ]
    assert got["idle"] > 0  # some expert had no token on some rank's micro-batch: its gradient is still reduced

    t = Trainer(_model(), TrainConfig(**CFG))
    lipschitz_adam(t)
    grads = capture_grads(t)
    a, b = _batches()
    m1, m2 = t.step(*a), t.step(*b)
    for k in ("loss", "grad_norm", "moe_tokens_per_expert_max", "moe_tokens_per_expert_min", "moe_idle_experts"):
        assert got["metrics"][0][k] == pytest.approx(m1[k], rel=1e-5), k
        assert got["metrics"][1][k] == pytest.approx(m2[k], rel=1e-5), k
    assert_same(
        {k.removeprefix("lm."): v for k, v in got["grads"].items()},
        {k.removeprefix("lm."): v for k, v in grads[1].items()},
    )
    assert_same(got["full"], t.full_state_dict(), atol=1e-5)
    aux = got["aux_metrics"]  # with --train.router-aux-coef: the same steps run, with the aux loss reported
    assert all(m["moe_aux_loss"] > 0 and m["grad_norm"] > 0 for m in aux) and aux[0]["loss"] == pytest.approx(
        m1["loss"]
    )


def _worker():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = Path(os.environ["STALEFLOW_TEST_OUT"])
    t = Trainer(_model(), TrainConfig(**CFG), process_group=dist.group.WORLD)
    lipschitz_adam(t)
    grads = capture_grads(t)
    idle = []
    forward = t._forward

    def spy(policy, mb):  # experts without a token in this rank's micro-batch
        result = forward(policy, mb)
        if policy is t.policy and policy.router_stats is not None:
            idle.append(int((policy.router_stats[:, 0] == 0).sum()))
        return result

    t._forward = spy
    metrics = [t.step(*b) for b in _batches()]
    units = sorted(n for n, m in t.policy.named_modules() if hasattr(m, "_get_fsdp_state") and n.startswith("lm."))
    with_aux = Trainer(_model(), TrainConfig(**CFG, router_aux_coef=0.01), process_group=dist.group.WORLD)
    aux_metrics = [with_aux.step(*b) for b in _batches()]
    full = t.full_state_dict()
    idle_all = torch.tensor(sum(idle))
    dist.all_reduce(idle_all)
    if dist.get_rank() == 0:
        torch.save(
            {
                "metrics": metrics,
                "grads": grads[1],
                "full": full,
                "units": units,
                "idle": int(idle_all),
                "aux_metrics": aux_metrics,
            },
            out / "rank0.pt",
        )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as test_train_distributed: no interpreter shutdown under a live gloo thread


def test_moe_two_step_run_trains_and_exports_for_transformers(tmp_path):
    from run_helpers import metrics_rows, train_tiny

    flags = ("--model.path", "tiny-qwen3-moe", "--steps", "2", "--train.router-aux-coef", "0.01")
    train_tiny(tmp_path, "moe", *flags)
    run = tmp_path / "moe"
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert (
            r["bound_violations"] == 0
            and r["train"]["moe_tokens_per_expert_mean"] > 0
            and r["train"]["moe_aux_loss"] > 0
        )
    from transformers import AutoModelForCausalLM

    from staleflow.model import PackedAttention, load_model

    hf = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
    ours = load_model(str(run / "hf"))
    ids = torch.tensor([1, 5, 9, 100, 7, 42])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(6), PackedAttention(torch.tensor([0, 6], dtype=torch.int32))))
    assert (ref - got).abs().max() <= 1e-5
    init = load_model("tiny-qwen3-moe")  # trained: the weights moved, experts included
    moved = [
        n
        for n, (a, b) in zip(ours.state_dict(), zip(init.state_dict().values(), ours.state_dict().values()))
        if not torch.equal(a, b)
    ]
    assert any(".mlp.experts." in n for n in moved) and any(n.endswith("mlp.gate.weight") for n in moved)


if __name__ == "__main__":
    _worker()
