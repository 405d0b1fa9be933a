"""--train.compute-dtype on CPU: bf16 autocast of the decoder with the LM head and log-probs in
fp32, fp32 master weights; float32 (the CPU default) is the exact path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import flat, random_batch, tiny_model  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.train.parallelize import compute_dtype  # noqa: E402
from staleflow.train.trainer import Trainer  # noqa: E402


def _logps(dtype: str):
    t = Trainer(tiny_model(seed=1), TrainConfig(lr=1e-3, micro_batch_tokens=64, compute_dtype=dtype))
    batch = random_batch(seed=2, groups=2)
    tokens = flat(batch)
    t._oversize = 0
    mbs = t._plan(tokens, list(range(len(tokens))), [0.0] * len(tokens))
    with torch.no_grad():
        return t, batch, torch.cat([t._forward(t.policy, mb)[0] for mb in mbs])


def test_compute_dtype_choice():
    assert compute_dtype("cpu") == torch.float32 and compute_dtype("cuda") == torch.bfloat16
    assert compute_dtype("cpu", "bfloat16") == torch.bfloat16 and compute_dtype("cuda", "float32") == torch.float32
    with pytest.raises(ValueError, match="compute-dtype"):
        compute_dtype("cpu", "fp8")


def test_cpu_bf16_autocast_keeps_master_weights_and_head_in_fp32():
    _, _, ref = _logps("auto")
    _, _, exact = _logps("float32")
    assert torch.equal(ref, exact)  # auto on CPU is the exact fp32 path
    t, batch, bf = _logps("bfloat16")
    assert bf.dtype == torch.float32  # log-probs come out of an fp32 head
    assert (bf - ref).abs().max().item() < 0.1 and not torch.equal(bf, ref)  # bf16 decoder: close, not equal
    metrics = t.step(*batch)
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
