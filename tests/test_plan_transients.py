"""The memory plan's short-lived buffers (plan/transients.py) against the code that makes them: each
runs on CPU under a dispatch mode that records its allocations (tests/peak_memory.py) and the
plan's formula at that shape must cover the measured peak, tightly. Then the rows in the plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import PeakAllocations  # noqa: E402
from test_train_helpers import random_batch, tiny_model  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.plan.transients import adamw_step_bytes, logprob_backward_bytes, prefill_mask_bytes  # noqa: E402


def test_plan_adamw_step_counts_the_trainers_foreach_temporaries():
    from staleflow.train.trainer import Trainer

    t = Trainer(tiny_model(seed=0), TrainConfig(lr=1e-2, micro_batch_tokens=64))
    t.step(*random_batch(seed=1, groups=2))  # the optimizer state exists
    for p in t.policy.parameters():
        p.grad = torch.randn_like(p)
    with PeakAllocations() as peak:
        t.optimizer.step()
    numel = sum(p.numel() for p in t.policy.parameters())
    assert peak.peak == adamw_step_bytes(numel) > 0
    assert {a[0] for a in peak.allocs} == {"aten._foreach_sqrt.default"}


def _out_dtype_in_place() -> bool:
    acc = torch.zeros(4, 4)
    a = torch.randn(4, 4, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _mm_out_dtype() -> bool:
    a = torch.randn(4, 4, dtype=torch.bfloat16)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_logprob_backward_workspace_covers_the_triton_backward(monkeypatch, dtype):
    from staleflow.kernels import logprob as lp

    if not lp.triton_available():
        pytest.skip("triton is not installed (the kernel cannot run here)")
    monkeypatch.setattr(lp, "BWD_CHUNK_TOKENS", 16)
    T, H, V = 40, 32, 96
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    logp, ent = lp.packed_logprobs_triton(hidden, weight, targets, 1.0, torch.ones(T, dtype=torch.bool))
    loss = logp.sum() + ent.sum()
    with PeakAllocations() as peak:
        loss.backward()
    plan = logprob_backward_bytes(
        T, H, V, dtype, chunk=16, inplace_fp32_accumulate=_out_dtype_in_place(), mm_out_dtype=_mm_out_dtype()
    )
    assert peak.peak <= plan <= 1.15 * peak.peak, (peak.peak, plan, peak.allocs)
    fp32_dw = [a for a in peak.allocs if a[1] == (V, H) and a[2] == torch.float32]
    assert len(fp32_dw) == 1  # the one fp32 accumulator the plan's formula starts from


def test_plan_logprob_backward_at_qwen_7b_is_the_issues_four_gib():
    got = logprob_backward_bytes(16384, 3584, 152064, torch.bfloat16)
    dw32, dz, dw16 = 152064 * 3584 * 4, (1 << 30) // (152064 * 2) // 128 * 128 * 152064 * 2, 152064 * 3584 * 2
    assert dw32 + dz + dw16 < got < dw32 + dz + dw16 + (256 << 20)  # + dH [16k, H] and the chunk rows


@pytest.mark.parametrize("heads,kv", [(8, 2), (4, 4)])
def test_plan_prefill_mask_matches_prefill_sdpa_allocations(heads, kv):
    from staleflow.rollout.paged_attention import prefill_sdpa

    n, L, D = 16, 48, 32
    q = torch.randn(heads, n, D, dtype=torch.bfloat16)
    k = torch.randn(kv, L, D, dtype=torch.bfloat16)
    mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)
    with PeakAllocations() as peak:
        prefill_sdpa(q, k, k, mask, stack_groups=True)  # what the CUDA path runs
    # SDPA's additive copy [n, L] (broadcast to every head, never repeated per GQA group) + the bool mask
    masks = [a for a in peak.allocs if a[1] and tuple(a[1][-2:]) == (n, L)]  # what has the mask's shape
    added = sum(a[3] for a in masks)
    assert added == n * L * 2
    assert added + mask.nbytes == prefill_mask_bytes(SimpleNamespace(num_heads=heads, num_kv_heads=kv), n, L, 2)


def test_plan_table_shows_the_transients_and_7b_still_fits():
    from staleflow.plan import build_plan
    from staleflow.plan.estimate import PHASES
    from staleflow.plan.report import table
    from staleflow.presets import preset_gpu_7b

    cfg = preset_gpu_7b()
    plan = build_plan(cfg, nproc=8, gpu_bytes=80 << 30, flash=False)
    assert plan.fits
    trainer, rollout = plan.ranks[0], plan.ranks[-1]
    # one fp32 copy of the local shard: the optimizer's two moments minus its 4-byte step per tensor
    assert 0 < trainer.items["optimizer"] - 2 * trainer.items["optim_step"] < 4 * 400
    assert trainer.items["logprob_bwd"] > 4 << 30
    qwen = SimpleNamespace(num_heads=28, num_kv_heads=4)
    chunk, ctx = cfg.rollout.prefill_chunk_tokens, cfg.rollout.max_model_len
    assert rollout.items["prefill_mask"] == prefill_mask_bytes(qwen, chunk, ctx, 2) == chunk * ctx * 3
    head = table(plan).splitlines()[1].split()
    assert {"adamw", "lp_bwd", "mask"} <= set(head)
    # the optimizer step's temporaries are not live with the activations: the peak takes the larger phase
    backward = sum(trainer.items.get(k, 0) for k, p in PHASES.items() if p == "backward")
    assert trainer.steady == sum(trainer.items.values()) - min(backward, trainer.items["optim_step"])


def test_plan_help_shows_the_plans_own_flags():
    out = subprocess.run(
        [sys.executable, "-m", "staleflow", "plan", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--gpu-memory-gib", "--nproc", "--gpus", "--device"):
        assert flag in out.stdout
    assert "staleflow plan" in out.stdout.splitlines()[0]
    assert "--train.micro-batch-tokens" not in out.stdout  # not train's help
