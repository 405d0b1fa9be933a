"""Specification of the fused LM-head log-prob/entropy kernels against an fp64 reference.

Runs the Triton kernels under TRITON_INTERPRET=1 on CPU (set by conftest before import) or on
CUDA; skips cleanly when neither is possible. Tiny shapes: the interpreter costs ms per program.
"""

import math
import os

import pytest
import torch

from staleflow.kernels import logprob as kl
from staleflow.kernels.logprob import packed_logprobs_forward, packed_logprobs_triton, triton_available
from staleflow.kernels.reference import packed_logprobs_reference

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="needs triton with a CUDA GPU, or TRITON_INTERPRET=1 set before import"
)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not _INTERPRET else "cpu"
H, V, TAU = 64, 1000, 0.7  # V = 7 * 128 + 104: not a multiple of any block size


def packed_batch(lengths, prompt_lens, H=H, V=V, seed=0, logit_scale=1.0):
    """Packed sequences: hidden [T, H], weight [V, H], targets [T], row_mask [T].

    Targets are the next token inside the same sequence; prompt tokens and each sequence's last
    token are unselected (row_mask False) and get target -100 (the trainer's convention).
    """
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    ids = torch.randint(0, V, (T,), generator=g)
    targets = torch.full((T,), -100, dtype=torch.long)
    row_mask = torch.zeros(T, dtype=torch.bool)
    start = 0
    for n, p in zip(lengths, prompt_lens):
        for t in range(start + p, start + n - 1):
            targets[t] = ids[t + 1]
            row_mask[t] = True
        start += n
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (logit_scale / math.sqrt(H))
    return (hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE), row_mask.to(DEVICE))


LENGTHS, PROMPTS = [23, 9, 41, 2, 27], [5, 3, 10, 1, 6]  # T = 102, five sequences


def _run_both(hidden, weight, targets, row_mask, temperature, seed=1):
    """Triton and fp64-reference outputs and gradients for a random upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    T = hidden.shape[0]
    g_lp = torch.randn(T, generator=g).to(DEVICE)
    g_h = torch.randn(T, generator=g).to(DEVICE)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = packed_logprobs_triton(h1, w1, targets, temperature, row_mask)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rlp, rent = packed_logprobs_reference(h2, w2, targets, temperature, row_mask)
    ((rlp * g_lp.double()).sum() + (rent * g_h.double()).sum()).backward()
    return (lp, ent, h1.grad, w1.grad), (rlp, rent, h2.grad, w2.grad)


def _assert_grad_close(got, ref, rel=1e-4):
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.double(), ref, rtol=rel, atol=rel * scale)
    assert (got.double() - ref).norm() <= rel * ref.norm()


def test_matches_fp64_reference_with_temperature_and_ignored_rows():
    hidden, weight, targets, row_mask = packed_batch(LENGTHS, PROMPTS)
    (lp, ent, dh, dw), (rlp, rent, rdh, rdw) = _run_both(hidden, weight, targets, row_mask, TAU)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (hidden.shape[0],)
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=0, atol=1e-4)
    _assert_grad_close(dh, rdh)
    _assert_grad_close(dw, rdw)
    # Ignored rows: exactly zero outputs and exactly zero gradient.
    assert torch.all(lp[~row_mask] == 0) and torch.all(ent[~row_mask] == 0)
    assert torch.all(dh[~row_mask] == 0)


def test_invariants_logp_nonpositive_entropy_in_range():
    hidden, weight, targets, row_mask = packed_batch(LENGTHS, PROMPTS, logit_scale=4.0, seed=3)
    lp, ent = packed_logprobs_triton(hidden, weight, targets, 0.5, row_mask)
    assert torch.all(lp <= 0)
    assert torch.all(ent >= 0) and torch.all(ent <= math.log(V) * (1 + 1e-6))
    # Uniform distribution (zero weight): entropy = log V, logp = -log V.
    lp0, ent0 = packed_logprobs_triton(hidden, torch.zeros_like(weight), targets, 1.3, row_mask)
    torch.testing.assert_close(
        lp0[row_mask].double(), torch.full_like(lp0[row_mask], -math.log(V)).double(), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        ent0[row_mask].double(), torch.full_like(ent0[row_mask], math.log(V)).double(), rtol=0, atol=1e-5
    )


def test_very_negative_and_peaked_logits():
    """All logits far below zero (verl PR #7439's failure) and near-one-hot rows stay exact."""
    hidden, weight, targets, row_mask = packed_batch(LENGTHS, PROMPTS, seed=4, logit_scale=8.0)
    hidden[:, 0] = 1.0
    weight[:, 0] = -500.0  # shifts every logit by -500 / tau; softmax unchanged
    (lp, ent, dh, dw), (rlp, rent, rdh, rdw) = _run_both(hidden, weight, targets, row_mask, TAU)
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=1e-5 * 50)  # |z| ~ 700: fp32 ulp ~ 6e-5
    torch.testing.assert_close(ent.double(), rent, rtol=0, atol=1e-4)
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    assert torch.all(lp <= 0) and torch.all(ent >= 0)


def test_every_output_element_written_and_no_unwritten_partial_read():
    hidden, weight, targets, row_mask = packed_batch(LENGTHS, PROMPTS, seed=5)
    T = hidden.shape[0]
    cfg = kl.default_config(hidden.device, hidden.dtype)
    out = tuple(torch.full((T,), float("nan"), device=DEVICE) for _ in range(4))
    ws = kl.forward_workspace(T, cfg, DEVICE).fill_(float("nan"))
    lp, ent, lse, ez, _, _ = packed_logprobs_forward(hidden, weight, targets, TAU, row_mask, out=out, workspace=ws)
    assert all(torch.isfinite(x).all() for x in (lp, ent, lse, ez))
    rlp, rent = packed_logprobs_reference(hidden, weight, targets, TAU, row_mask)
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=0, atol=1e-4)


def _ulps_of_row(lp, ent, lse2):
    """One fp32 ulp at each row's largest magnitude among logp, entropy and log-sum-exp (nats)."""
    scale = torch.maximum((lse2 * math.log(2)).abs(), torch.maximum(lp.abs(), ent.abs())).clamp_min(1e-30)
    return torch.finfo(torch.float32).eps * torch.exp2(torch.floor(torch.log2(scale)))


def test_sequence_result_independent_of_packing():
    """A sequence's outputs do not depend on what else is packed with it, or where.

    The kernel's design makes a token's result a function of its own row, the weight, its target
    and the fixed tile configuration (the vocabulary split depends on V only, never on T). On CUDA
    that is bitwise batch invariance at any offset: every row of a tile goes through the same
    MMA instruction sequence.

    Under TRITON_INTERPRET=1 a tile product is a numpy matmul, i.e. a BLAS sgemm whose rounding
    for a row can depend on the row's POSITION inside the [BLOCK_M, BLOCK_K] tile (OpenBLAS's
    Haswell/Zen kernels do, the SkylakeX one does not: issue 29, measured with OPENBLAS_CORETYPE).
    Its neighbours' values never matter. So on CPU this asserts:
    1. bitwise equality when the sequence keeps its position in the tile (packed at a
       non-aligned token offset, behind and ahead of other sequences, with another T and other
       split/merge programs): any error in row selection, splitting or merging would show here;
    2. at a different position in the tile, agreement within 16 fp32 ulps of the row's largest
       magnitude (|logp|, entropy, log-sum-exp): the two results are the same computation up to
       the summation order of each K-term dot product, which moves a logit by a few ulps and
       log-sum-exp is 1-Lipschitz in the logits. Measured worst case: 5 ulps over 100 random
       packs with OpenBLAS's Haswell kernel; a row-mixing bug is off by O(1), not by ulps.
    """
    cfg = kl.default_config(torch.device(DEVICE), torch.float32)
    # 1. same position in the tile: two neighbours with block_m // 2 selected rows each in front
    half = cfg.block_m // 2
    lengths, prompts = [half + 4, half + 4, 41, 9], [3, 3, 10, 3]
    hidden, weight, targets, row_mask = packed_batch(lengths, prompts, seed=6)
    a0, a1 = sum(lengths[:2]), sum(lengths[:3])
    assert int(row_mask[:a0].sum()) == cfg.block_m and a0 % cfg.block_m != 0
    lp_all, ent_all = packed_logprobs_triton(hidden, weight, targets, TAU, row_mask)
    lp_one, ent_one = packed_logprobs_triton(hidden[a0:a1], weight, targets[a0:a1], TAU, row_mask[a0:a1])
    assert torch.equal(lp_all[a0:a1], lp_one) and torch.equal(ent_all[a0:a1], ent_one)
    # ... and with every row selected (no mask), the sequence first in the pack
    hidden, weight, targets, row_mask = packed_batch(LENGTHS, PROMPTS, seed=6)
    a0, a1 = sum(LENGTHS[:2]), sum(LENGTHS[:3])  # the third sequence (41 tokens)
    sel = torch.cat([torch.arange(a0, a1), torch.arange(0, a0)]).to(DEVICE)
    tg = torch.where(row_mask, targets, 0)
    lp_p, ent_p = packed_logprobs_triton(hidden[sel], weight, tg[sel], TAU)
    lp_s, ent_s = packed_logprobs_triton(hidden[a0:a1], weight, tg[a0:a1], TAU)
    assert torch.equal(lp_p[: a1 - a0], lp_s) and torch.equal(ent_p[: a1 - a0], ent_s)
    # 2. another position in the tile: 22 selected rows in front of this sequence's 30
    lp_all, ent_all = packed_logprobs_triton(hidden, weight, targets, TAU, row_mask)
    lp_one, ent_one, lse2, *_ = packed_logprobs_forward(hidden[a0:a1], weight, targets[a0:a1], TAU, row_mask[a0:a1])
    if DEVICE == "cuda":
        assert torch.equal(lp_all[a0:a1], lp_one) and torch.equal(ent_all[a0:a1], ent_one)
    else:
        tol = 16 * _ulps_of_row(lp_one, ent_one, lse2)
        assert torch.all((lp_all[a0:a1] - lp_one).abs() <= tol), (lp_all[a0:a1] - lp_one).abs().max()
        assert torch.all((ent_all[a0:a1] - ent_one).abs() <= tol), (ent_all[a0:a1] - ent_one).abs().max()


def test_no_mask_equals_all_true_mask_and_backward_chunking(monkeypatch):
    """No mask and an all-True mask select the same rows at the same tile positions: bitwise equal
    outputs. Chunking the backward moves rows to other positions of the recomputed logits tile, so
    dz, and dH = dz @ W, agree up to the summation order of the interpreter's tile product (see
    test_sequence_result_independent_of_packing): within 1e-6 of dH's largest element (~8 fp32
    ulps; measured worst 2.8e-7 relative with OpenBLAS's Haswell kernel), bitwise on most BLAS."""
    hidden, weight, targets, row_mask = packed_batch(LENGTHS, PROMPTS, seed=7)
    targets = torch.where(row_mask, targets, 3)
    full = torch.ones_like(row_mask)
    (lp, ent, dh, dw), _ = _run_both(hidden, weight, targets, None, TAU)
    monkeypatch.setattr(kl, "BWD_CHUNK_TOKENS", 17)  # several backward chunks, ragged last one
    (lp2, ent2, dh2, dw2), (rlp, rent, rdh, rdw) = _run_both(hidden, weight, targets, full, TAU)
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2)
    torch.testing.assert_close(dh, dh2, rtol=1e-6, atol=1e-6 * dh.abs().max().item())
    torch.testing.assert_close(dw, dw2, rtol=1e-5, atol=1e-6)
    _assert_grad_close(dw2, rdw)
    _assert_grad_close(dh2, rdh)


def test_grad_only_for_hidden_and_all_rows_masked():
    hidden, weight, targets, row_mask = packed_batch(LENGTHS[:2], PROMPTS[:2], seed=8)
    h = hidden.clone().requires_grad_()
    lp, ent = packed_logprobs_triton(h, weight, targets, TAU, row_mask)
    (lp.sum() + ent.sum()).backward()
    h2 = hidden.double().requires_grad_()
    rlp, rent = packed_logprobs_reference(h2, weight.double(), targets, TAU, row_mask)
    (rlp.sum() + rent.sum()).backward()
    _assert_grad_close(h.grad, h2.grad)
    # Nothing selected: zero outputs, zero gradients, no kernel work past the row selection.
    none = torch.zeros_like(row_mask)
    h3, w3 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp3, ent3 = packed_logprobs_triton(h3, w3, targets, TAU, none)
    (lp3.sum() + ent3.sum()).backward()
    assert torch.all(lp3 == 0) and torch.all(ent3 == 0)
    assert torch.all(h3.grad == 0) and torch.all(w3.grad == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    hidden, weight, targets, row_mask = packed_batch(LENGTHS[:3], PROMPTS[:3], seed=9)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    (lp, ent, dh, dw), (rlp, rent, rdh, rdw) = _run_both(hidden, weight, targets, row_mask, TAU)
    assert dh.dtype == dw.dtype == dtype and lp.dtype == torch.float32
    # Inputs are exactly representable, accumulation is fp32: outputs as accurate as for fp32.
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=0, atol=1e-4)
    # Gradients pass through a dz workspace and outputs in the input dtype.
    _assert_grad_close(dh, rdh, rel=2e-2)
    _assert_grad_close(dw, rdw, rel=2e-2)


def test_bad_inputs_raise_clear_errors():
    hidden, weight, targets, row_mask = packed_batch(LENGTHS[:2], PROMPTS[:2], seed=10)
    with pytest.raises(ValueError, match="temperature"):
        packed_logprobs_triton(hidden, weight, targets, 0.0, row_mask)
    with pytest.raises(ValueError, match="weight"):
        packed_logprobs_triton(hidden, weight[:, :-1], targets, 1.0, row_mask)
    with pytest.raises(ValueError, match="row_mask"):
        packed_logprobs_triton(hidden, weight, targets, 1.0, row_mask.int())
    with pytest.raises(ValueError, match="dtypes"):
        packed_logprobs_triton(hidden, weight.double(), targets, 1.0, row_mask)
    if DEVICE == "cpu":
        bad = targets.clone()
        bad[row_mask.nonzero()[0]] = V
        with pytest.raises(ValueError, match="targets"):
            packed_logprobs_triton(hidden, weight, bad, 1.0, row_mask)


def test_trainer_entry_point_selects_this_kernel():
    """The trainer's packed_logprobs(impl="triton") runs this kernel and agrees with its chunked path."""
    logprobs = pytest.importorskip("staleflow.train.logprobs")
    hidden, weight, targets, row_mask = packed_batch(LENGTHS[:3], PROMPTS[:3], seed=11)
    lp_t, ent_t = logprobs.packed_logprobs(hidden, weight, targets, temperature=TAU, row_mask=row_mask, impl="triton")
    lp_k, ent_k = packed_logprobs_triton(hidden, weight, targets, TAU, row_mask)
    assert torch.equal(lp_t, lp_k) and torch.equal(ent_t, ent_k)
    lp_c, ent_c = logprobs.packed_logprobs(hidden, weight, targets, temperature=TAU, row_mask=row_mask, impl="chunked")
    torch.testing.assert_close(lp_t, lp_c, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_t, ent_c, rtol=0, atol=1e-4)
