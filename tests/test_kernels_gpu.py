"""GPU-only checks of the fused log-prob/entropy kernels on real LM-head shapes (bf16).

Skipped without CUDA (and under TRITON_INTERPRET=1). Run by scripts/device_check.sh; also runnable
without pytest: ``TRITON_INTERPRET=0 python tests/test_kernels_gpu.py``.
"""

import math
import os

import torch

try:
    import pytest
except ImportError:  # the device machine may lack pytest: see __main__ below
    pytest = None

_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if pytest is not None:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU without the interpreter")]

SHAPES = [(4096, 152064), (896, 151936)]  # (H, V): Qwen 7B/8B-class and Qwen2.5-0.5B heads


def _batch(T, H, V, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(V, H, device="cuda", generator=g) * (2.0 / math.sqrt(H))).to(dtype)
    targets = torch.randint(0, V, (T,), device="cuda", generator=g)
    row_mask = torch.rand(T, device="cuda", generator=g) > 0.25
    row_mask[: T // 8] = False  # a long prompt block: whole tiles skipped
    return hidden, weight, targets, row_mask


def _check_shape(H, V, T=2048, tau=0.9):
    from staleflow.kernels.logprob import packed_logprobs_triton
    from staleflow.kernels.reference import packed_logprobs_reference

    hidden, weight, targets, row_mask = _batch(T, H, V, seed=H)
    g = torch.Generator(device="cuda").manual_seed(1)
    g_lp, g_h = torch.randn(T, device="cuda", generator=g), torch.randn(T, device="cuda", generator=g)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = packed_logprobs_triton(h1, w1, targets, tau, row_mask)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rlp, rent = packed_logprobs_reference(h2, w2, targets, tau, row_mask)
    ((rlp * g_lp.double()).sum() + (rent * g_h.double()).sum()).backward()
    err_lp = (lp.double() - rlp).abs().max().item()
    err_ent = (ent.double() - rent).abs().max().item()
    rel_dh = ((h1.grad.double() - h2.grad).norm() / h2.grad.norm()).item()
    rel_dw = ((w1.grad.double() - w2.grad).norm() / w2.grad.norm()).item()
    print(f"H={H} V={V} T={T}: max|dlogp|={err_lp:.2e} max|dent|={err_ent:.2e} rel dH={rel_dh:.2e} rel dW={rel_dw:.2e}")
    assert bool(torch.all(lp <= 0)) and bool(torch.all(ent >= 0))
    assert bool(torch.all(ent <= math.log(V) * (1 + 1e-6)))
    assert err_lp < 1e-4 and err_ent < 1e-3
    assert rel_dh < 1e-2 and rel_dw < 1e-2  # dz and the grads are stored in bf16
    assert bool(torch.all(h1.grad[~row_mask] == 0))


def test_real_shapes_match_fp64_reference():
    for H, V in SHAPES:
        _check_shape(H, V)


def test_real_shape_several_backward_chunks():
    """dW accumulates across backward chunks (T=2048 is one chunk by default)."""
    from staleflow.kernels import logprob as kl

    saved = kl.BWD_CHUNK_TOKENS
    kl.BWD_CHUNK_TOKENS = 500  # ragged: 4 full chunks + 1 partial of the ~1500 selected rows
    try:
        _check_shape(*SHAPES[1])
    finally:
        kl.BWD_CHUNK_TOKENS = saved


def test_real_shape_batch_invariance():
    """A sequence's outputs are bitwise identical alone and inside a large pack."""
    from staleflow.kernels.logprob import packed_logprobs_triton

    H, V = SHAPES[1]
    hidden, weight, targets, row_mask = _batch(8192, H, V, seed=7)
    a0, a1 = 3001, 3001 + 777
    with torch.no_grad():
        lp, ent = packed_logprobs_triton(hidden, weight, targets, 1.0, row_mask)
        lp1, ent1 = packed_logprobs_triton(hidden[a0:a1], weight, targets[a0:a1], 1.0, row_mask[a0:a1])
    assert torch.equal(lp[a0:a1], lp1) and torch.equal(ent[a0:a1], ent1)


def test_fp32_batch_invariance_at_another_tile_position():
    """fp32 (exact fp32 dots): bitwise identical alone and packed where the sequence's first
    selected row sits at another position of its BLOCK_M tile. The CPU interpreter can only
    promise that up to a few ulps (its tile product is a BLAS sgemm): tests/test_kernels.py."""
    from staleflow.kernels import logprob as kl

    H, V = SHAPES[1]
    hidden, weight, targets, row_mask = _batch(1024, H, V, seed=5, dtype=torch.float32)
    block_m = kl.default_config(hidden.device, torch.float32).block_m
    a0, a1 = 333, 333 + 300
    before = int(row_mask[:a0].sum())
    if before % block_m == 0:  # the random mask put the sequence at tile position 0: move it by one
        row_mask[a0 - 1] = not bool(row_mask[a0 - 1])
        before = int(row_mask[:a0].sum())
    assert before % block_m != 0
    with torch.no_grad():
        lp, ent = kl.packed_logprobs_triton(hidden, weight, targets, 0.8, row_mask)
        lp1, ent1 = kl.packed_logprobs_triton(hidden[a0:a1], weight, targets[a0:a1], 0.8, row_mask[a0:a1])
    assert torch.equal(lp[a0:a1], lp1) and torch.equal(ent[a0:a1], ent1)


def test_forward_extra_memory_is_linear_in_tokens():
    from staleflow.kernels.logprob import packed_logprobs_triton

    H, V = SHAPES[1]
    T = 16384
    hidden, weight, targets, row_mask = _batch(T, H, V, seed=11)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        packed_logprobs_triton(hidden, weight, targets, 1.0, row_mask)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    print(f"forward extra memory at T={T}: {extra / 2**20:.1f} MiB ([T, V] fp32 would be {T * V * 4 / 2**30:.1f} GiB)")
    assert extra < 512 * T + (1 << 20)


if __name__ == "__main__":
    if not _GPU:
        raise SystemExit("needs a CUDA GPU and TRITON_INTERPRET unset or 0")
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print(f"PASS {name}")
