"""Cost-model profiling: the engine records one CostSample per step, and the one fitter
(staleflow.coordinator.fit_cost_model) recovers known coefficients from synthetic samples."""

import numpy as np
import pytest
import torch

from staleflow.coordinator import CostModel, CostModelError, fit_cost_model
from staleflow.coordinator.cost_model import fit_error
from staleflow.model import CausalLM, ModelArgs
from staleflow.rollout import BuiltinEngine, Request, SamplingParams

# the paper's Qwen2.5-32B magnitudes; a constant per-step cost k4 is absorbed into k2 and b3
TRUE = CostModel(k1=6e-8, k2=0.02, k3=2.5e-4, b3=0.0, k4=2e-3, kv_capacity=1 << 20)


def synthetic(noise: float, seed: int = 0, outliers: int = 0) -> list[tuple[int, float, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256):
        for kv_per_seq in (100, 1000, 4000):
            kv = n * kv_per_seq
            out.append((n, float(kv), TRUE.step_time(n, kv) * (1 + noise * rng.standard_normal())))
    for i in range(outliers):  # steps slowed 3x by another job on a shared host
        n, kv, y = out[(7 * i) % len(out)]
        out[(7 * i) % len(out)] = (n, kv, 3 * y)
    return out


def test_fit_recovers_known_coefficients():
    fit = fit_cost_model(synthetic(noise=0.0), TRUE.kv_capacity)
    assert fit.k1 == pytest.approx(TRUE.k1, rel=1e-3) and fit.k3 == pytest.approx(TRUE.k3, rel=1e-3)
    assert fit.k2 == pytest.approx(TRUE.k2 + TRUE.k4, rel=1e-3)  # max(k2, k3 n) + k4 == max(k2 + k4, k3 n + k4)
    assert fit.b3 == pytest.approx(TRUE.k4, rel=1e-2)
    assert fit_error(fit, synthetic(noise=0.0))[1] < 1e-3


@pytest.mark.parametrize("outliers", [0, 4])
def test_fit_with_noise_and_outliers_predicts_step_times(outliers):
    fit = fit_cost_model(synthetic(noise=0.03, seed=1, outliers=outliers), TRUE.kv_capacity)
    for n, kv in ((8, 8000), (64, 64000), (200, 400000)):
        assert fit.step_time(n, kv) == pytest.approx(TRUE.step_time(n, kv), rel=0.05)
    if outliers:  # the same samples without the robust loss are pulled towards the slow steps
        plain = fit_cost_model(synthetic(noise=0.03, seed=1, outliers=outliers), TRUE.kv_capacity, robust=False)

        def err(m):
            return sum(abs(m.step_time(n, kv) / TRUE.step_time(n, kv) - 1) for n, kv, _ in synthetic(0.0))

        assert err(fit) < err(plain)


def test_fit_needs_decode_samples():
    with pytest.raises(CostModelError, match="at least 4"):
        fit_cost_model([(4, 100.0, 0.1)], 1000)


def test_engine_profile_samples_describe_each_step():
    torch.manual_seed(0)
    model = CausalLM(ModelArgs(vocab_size=64, eos_token_ids=[1])).init_weights(seed=0)
    # the prompts share their first block: without prefix sharing each prefills all of its tokens
    eng = BuiltinEngine(
        model,
        max_kv_tokens=256,
        block_size=4,
        prefill_chunk_tokens=16,
        max_model_len=64,
        profile=True,
        prefix_sharing=False,
    )
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
