"""Property tests (hypothesis) for the fused log-prob/entropy kernels: random packings, masks,
vocabulary sizes and temperatures all match the fp64 reference and keep the invariants.

Runs under TRITON_INTERPRET=1 on CPU (conftest) or on CUDA; skipped when neither is possible.
"""

import math
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from staleflow.kernels.logprob import packed_logprobs_triton, triton_available  # noqa: E402
from staleflow.kernels.reference import packed_logprobs_reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="needs triton with a CUDA GPU, or TRITON_INTERPRET=1 set before import"
)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not _INTERPRET else "cpu"


@st.composite
def packings(draw):
    n_seq = draw(st.integers(1, 5))
    lengths = [draw(st.integers(1, 24)) for _ in range(n_seq)]
    prompts = [draw(st.integers(0, n)) for n in lengths]
    V = draw(st.integers(2, 700))
    H = draw(st.sampled_from([16, 40, 64]))
    temperature = draw(st.sampled_from([0.3, 0.7, 1.0, 1.9]))
    scale = draw(st.sampled_from([0.5, 2.0, 6.0]))
    return lengths, prompts, V, H, temperature, scale, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(packings())
@example(([8, 18, 1], [0, 0, 0], 63, 16, 0.3, 6.0, 0))  # |logp| ~ 130: needs the relative allowance
def test_random_packings_match_reference(case):
    lengths, prompts, V, H, temperature, scale, seed = case
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    row_mask = torch.zeros(T, dtype=torch.bool)
    start = 0
    for n, p in zip(lengths, prompts):
        row_mask[start + p : start + n] = True  # response tokens
        start += n
    targets = torch.where(row_mask, torch.randint(0, V, (T,), generator=g), -100)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (scale / math.sqrt(H))
    hidden, weight, targets, row_mask = (x.to(DEVICE) for x in (hidden, weight, targets, row_mask))
    g_lp, g_h = torch.randn(T, generator=g).to(DEVICE), torch.randn(T, generator=g).to(DEVICE)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = packed_logprobs_triton(h1, w1, targets, temperature, row_mask)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rlp, rent = packed_logprobs_reference(h2, w2, targets, temperature, row_mask)
    ((rlp * g_lp.double()).sum() + (rent * g_h.double()).sum()).backward()

    assert torch.all(lp <= 0) and torch.all(ent >= 0) and torch.all(ent <= math.log(V) * (1 + 1e-6) + 1e-6)
    # fp32 outputs: |logp| reaches ~100 here (scale 6, tau 0.3), where one fp32 ulp is ~1e-5,
    # so the absolute 1e-5 bound gets a 1e-6 relative allowance on top.
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-6, atol=1e-4)
    for got, ref in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        scale_ref = max(ref.abs().max().item(), 1e-12)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * scale_ref)
    assert torch.all(h1.grad[~row_mask] == 0)
