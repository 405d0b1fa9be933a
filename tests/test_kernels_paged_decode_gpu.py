"""Paged decode attention on a real GPU at real shapes (skipped without CUDA).

Shape: batch 64 at ~8k context (7168-8192 tokens, plus a 1-token, an exactly-8192 and a
partition-plus-one sequence), Qwen2.5-7B heads (28 query / 4 kv heads, head_dim 128), bf16,
cache block 16, blocks scattered at random over the cache and the unused blocks NaN. Checks the
kernel against the fp64 reference, bitwise batch invariance, and fp32 / fp16 at smaller shapes.

    python tests/test_kernels_paged_decode_gpu.py        # the checks, then the timing table (device_check.sh)
    pytest tests/test_kernels_paged_decode_gpu.py         # the checks only

The timing (never asserted) compares, per decode attention call of one layer: this kernel
(default and a few tile configurations), the engine's CUDA fallback before it (gather every
sequence's K/V into a padded batch with index_select, then one masked SDPA, GQA unexpanded) and
flash-attn's `flash_attn_with_kvcache` when importable (block 256). It prints hardware, shapes,
median ms, effective bandwidth (K/V bytes read once / time) and the ratio to the gather path; the
last line is JSON. Standalone: no hypothesis, no tyro.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "0")
from staleflow.kernels.paged_decode import paged_decode_attention  # noqa: E402
from staleflow.kernels.reference import paged_decode_reference  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
B, HQ, HKV, D, BLOCK = 64, 28, 4, 128, 16
DEV = torch.device("cuda")


def real_case(batch=B, lo=7168, hi=8192, dtype=torch.bfloat16, block=BLOCK, seed=0, edge_lengths=True):
    """q [B, Hq, D], k/v caches [slots, Hkv, D] (unused blocks NaN), tables int32, lens int32;
    edge_lengths: the first four sequences have 1, hi, 513 (one past a partition) and hi - 1 tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g)
    if edge_lengths:
        lens[:4] = torch.tensor([1, hi, 513, hi - 1])
    blocks = (lens + block - 1) // block
    num_blocks = int(blocks.sum()) + 8
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((batch, int(blocks.max())), 1 << 28, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks.tolist()):
        tables[b, :nb] = order[used : used + nb].int()
        used += nb
    dev = DEV
    k = torch.randn(num_blocks * block, HKV, D, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    spare = order[used:].to(dev)
    k.view(num_blocks, block, HKV, D)[spare] = float("nan")
    v.view(num_blocks, block, HKV, D)[spare] = float("nan")
    q = torch.randn(batch, HQ, D, device=dev, dtype=dtype)
    return q, k, v, tables.to(dev), lens.to(device=dev, dtype=torch.int32)


def check_against_reference(dtype, **shape):
    q, k, v, tables, lens = real_case(dtype=dtype, **shape)
    out = paged_decode_attention(q, k, v, tables, lens, BLOCK)
    ref = paged_decode_reference(q, k, v, tables, lens, BLOCK)
    err = (out.double() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= TOL[dtype], (dtype, err)
    return err


def test_real_shape_bf16_matches_reference():
    check_against_reference(torch.bfloat16)


def test_fp32_and_fp16_match_reference():
    check_against_reference(torch.float32, batch=8, lo=1500, hi=2048)
    check_against_reference(torch.float16, batch=16, lo=3000, hi=4096)


def test_real_shape_batch_invariance_is_bitwise():
    q, k, v, tables, lens = real_case(seed=1)
    both = paged_decode_attention(q, k, v, tables, lens, BLOCK)
    for i in (0, 3, 17):  # 1 token (direct write when alone), 513 tokens, a long one
        alone = paged_decode_attention(q[i : i + 1], k, v, tables[i : i + 1], lens[i : i + 1], BLOCK)
        assert torch.equal(alone, both[i : i + 1]), i


def gather_decode(q, k, v, tables, lens, block):
    """The engine's CUDA fallback: padded slot gather of K and V, then one masked SDPA."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    max_len = int(lens.max())
    pos = torch.arange(max_len, device=q.device)
    slots = tables.long()[:, pos // block] * block + pos % block  # [B, Lmax]
    valid = pos[None, :] < lens[:, None]
    slots = torch.where(valid, slots, 0)
    kd = k.index_select(0, slots.reshape(-1)).view(b, max_len, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    vd = v.index_select(0, slots.reshape(-1)).view(b, max_len, hkv, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), kd, vd, attn_mask=valid[:, None, None, :])
    return out.reshape(b, hq, d)


def median_ms(fn, iters=20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench() -> dict:
    q, k, v, tables, lens = real_case(seed=2, edge_lengths=False)
    kv_bytes = int(lens.sum()) * HKV * D * k.element_size() * 2
    res = {}
    # gather path: the null slot is slot 0 here, which is a real (finite) slot, masked anyway
    k0 = torch.nan_to_num(k)
    v0 = torch.nan_to_num(v)
    res["gather_ms"] = median_ms(lambda: gather_decode(q, k0, v0, tables, lens, BLOCK))
    ref = paged_decode_attention(q, k, v, tables, lens, BLOCK)
    assert (gather_decode(q, k0, v0, tables, lens, BLOCK).float() - ref.float()).abs().max() <= 2 * TOL[q.dtype]
    configs = [
        dict(),
        dict(block_n=32),
        dict(block_n=128, num_warps=8),
        dict(block_n=64, num_warps=8),
        dict(partition=256),
        dict(partition=1024),
        dict(num_stages=3),
    ]
    for cfg in configs:
        name = "triton" + "".join(f"_{k_}{v_}" for k_, v_ in cfg.items())
        out = paged_decode_attention(q, k, v, tables, lens, BLOCK, **cfg)
        assert (out.float() - ref.float()).abs().max() <= TOL[q.dtype], name
        res[f"{name}_ms"] = median_ms(
            lambda: paged_decode_attention(q, k, v, tables, lens, BLOCK, max_context_len=8192, **cfg)
        )
    try:
        from flash_attn import flash_attn_with_kvcache

        qf, kf, vf, tf, lf = real_case(seed=2, block=256, edge_lengths=False)
        kc, vc = kf.view(-1, 256, HKV, D), vf.view(-1, 256, HKV, D)
        res["flash_ms"] = median_ms(
            lambda: flash_attn_with_kvcache(qf[:, None], kc, vc, cache_seqlens=lf, block_table=tf)
        )
    except ImportError:
        res["flash_ms"] = None
    res = {n: (round(t, 4) if t is not None else None) for n, t in res.items()}
    res["kv_gb_per_call"] = round(kv_bytes / 1e9, 3)
    res["triton_speedup_vs_gather"] = round(res["gather_ms"] / res["triton_ms"], 2)
    best = min((t, n) for n, t in res.items() if n.startswith("triton") and n.endswith("_ms"))
    res["best_triton_config"] = best[1]
    rows = [
        ("hardware", torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter smoke run)"),
        ("torch / triton", f"{torch.__version__} / {__import__('triton').__version__}"),
        (
            "shape",
            f"batch {B}, context {int(lens.min())}-{int(lens.max())} (sum {int(lens.sum())}), "
            f"{HQ} q / {HKV} kv heads, D {D}, bf16, cache block {BLOCK}",
        ),
        ("K/V bytes per call", f"{kv_bytes / 1e9:.3f} GB (one layer)"),
    ]
    for n, t in res.items():
        if n.endswith("_ms") and t is not None:
            rows.append((n[:-3], f"{t:.3f} ms  {kv_bytes / t / 1e6:.0f} GB/s  {res['gather_ms'] / t:.2f}x vs gather"))
    width = max(len(a) for a, _ in rows)
    for a, b_ in rows:
        print(f"{a:<{width}}  {b_}")
    return res


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    status = "pass"
    for test in (
        test_real_shape_bf16_matches_reference,
        test_fp32_and_fp16_match_reference,
        test_real_shape_batch_invariance_is_bitwise,
    ):
        try:
            test()
            print(f"PASS {test.__name__}")
        except Exception as exc:  # reported, and the exit status says so
            status = "fail"
            print(f"FAIL {test.__name__}: {type(exc).__name__}: {exc}")
    result = bench()
    result["checks"] = status
    print(json.dumps(result))
    sys.exit(0 if status == "pass" else 1)
