"""Cost-model profiling: the engine records one CostSample per step, and the curve_fit of
latency = k1*KV + max(k2, k3*n) + k4 recovers known coefficients from synthetic samples."""

import numpy as np
import pytest
import torch

from staleflow.model import CausalLM, ModelArgs
from staleflow.rollout import BuiltinEngine, CostSample, Request, SamplingParams
from staleflow.rollout.profiling import fit_cost_model, latency_model

TRUE = dict(k1=6e-8, k2=0.02, k3=2.5e-4, k4=2e-3)  # the paper's Qwen2.5-32B magnitudes


def synthetic(noise: float, seed: int = 0) -> list[CostSample]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256):
        for kv_per_seq in (100, 1000, 4000):
            kv = n * kv_per_seq
            lat = latency_model(n, kv, **TRUE) * (1 + noise * rng.standard_normal())
            out.append(CostSample(n_running=n, kv_tokens=kv, prefill_tokens=0, latency_s=float(lat)))
    # prefill steps must be ignored by the fit even when wildly off
    out.append(CostSample(n_running=4, kv_tokens=4000, prefill_tokens=4000, latency_s=5.0))
    return out


def test_fit_recovers_known_coefficients():
    fit = fit_cost_model(synthetic(noise=0.0))
    for k, v in TRUE.items():
        assert fit[k] == pytest.approx(v, rel=1e-3, abs=1e-9), k
    assert fit["n_samples"] == 33 and fit["max_rel_err"] < 1e-6


def test_fit_with_noise_predicts_throughput():
    fit = fit_cost_model(synthetic(noise=0.03, seed=1))
    coeffs = {k: fit[k] for k in TRUE}
    assert all(v >= 0 for v in coeffs.values())
    for n, kv in ((8, 8000), (64, 64000), (200, 400000)):
        assert latency_model(n, kv, **coeffs) == pytest.approx(latency_model(n, kv, **TRUE), rel=0.05)


def test_fit_needs_decode_samples():
    with pytest.raises(ValueError, match="pure-decode samples"):
        fit_cost_model([CostSample(4, 100, 100, 0.1)])


def test_engine_profile_samples_describe_each_step():
    torch.manual_seed(0)
    model = CausalLM(ModelArgs(vocab_size=64, eos_token_ids=[1])).init_weights(seed=0)
    # the prompts share their first block: without prefix sharing each prefills all of its tokens
    eng = BuiltinEngine(model, max_kv_tokens=256, block_size=4, prefill_chunk_tokens=16, max_model_len=64,
                        profile=True, prefix_sharing=False)
    for i, plen in enumerate((5, 9, 7)):
        eng.add(Request(i, list(range(2, 2 + plen)), SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)))
    eng.step()
    first = eng.profile_samples[0]
    assert first.prefill_tokens == 16 and first.n_running == 3  # 5 + 9 + a 2-token chunk of the third
    while eng.has_unfinished():
        eng.step()
    decode = [s for s in eng.profile_samples if s.prefill_tokens == 0]
    assert decode and all(s.latency_s > 0 for s in decode)
    # step 2: decodes of the first two (5 + 1 and 9 + 1 tokens attended) + the third's last 5 prompt tokens
    second = eng.profile_samples[1]
    assert (second.n_running, second.prefill_tokens, second.kv_tokens) == (3, 5, 6 + 10 + 7)
    # last step: only the third sequence is left, attending its 7 prompt + 3 of its 4 outputs
    last = eng.profile_samples[-1]
    assert (last.n_running, last.prefill_tokens, last.kv_tokens) == (1, 0, 10)
