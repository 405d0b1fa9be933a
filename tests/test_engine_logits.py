"""Behaviour log-probs of a bf16 engine are the trainer's at identical weights (fp32 logits).

The engine used to round the sampled rows' logits to bf16 (the LM head product in bf16), while
the trainer computes `hidden.float() @ W.float().T` (staleflow.train.logprobs): a systematic
behaviour/trainer gap. Here every sampled row's hidden state is captured and scored by the
trainer's own function with the same bf16 weights in fp32; the engine's log-probs must agree to
fp32 rounding, and the old bf16-rounded logits of the same rows are shown to miss by far more.
"""

import pytest
import torch
import torch.nn.functional as F
from test_engine import make_hf, prompts

from staleflow.model import load_model
from staleflow.rollout import BuiltinEngine, Request, SamplingParams
from staleflow.rollout.model_runner import SampledLogits
from staleflow.train.logprobs import packed_logprobs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2")
    make_hf("qwen2", seed=3).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_behaviour_logprobs_match_trainer_fp32_logprobs(folder, temperature):
    model = load_model(folder, dtype=torch.bfloat16)
    eng = BuiltinEngine(model, max_kv_tokens=1024, block_size=4, prefill_chunk_tokens=16, max_model_len=96)
    rows = []  # (hidden [N, H] bf16, tokens [N], engine log-probs [N]) per step
    head, sampler = eng.runner.sampled_logits, eng.sampler

    def capture_hidden(hidden):
        rows.append([hidden.clone()])
        return head(hidden)

    def capture_sample(logits, params, seeds, positions):
        tokens, logprobs = sampler(logits, params, seeds, positions)
        rows[-1] += [torch.tensor(tokens), torch.tensor(logprobs, dtype=torch.float64)]
        return tokens, logprobs

    eng.runner.sampled_logits, eng.sampler = capture_hidden, capture_sample
    params = SamplingParams(temperature=temperature, max_new_tokens=12, ignore_eos=True, seed=7)
    eng.generate([Request(i, p, params) for i, p in enumerate(prompts(6, seed=2))])
    hidden = torch.cat([r[0] for r in rows])  # [N, H] bf16: exactly what the engine sampled from
    tokens = torch.cat([r[1] for r in rows])
    behaviour = torch.cat([r[2] for r in rows])
    weight = model.lm_head_weight  # bf16 [V, H]
    trainer, _ = packed_logprobs(hidden, weight, tokens, temperature, impl="chunked")  # fp32 of bf16 weights
    exact = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, -1)
    exact = exact.gather(1, tokens[:, None])[:, 0]
    rounded = torch.log_softmax(F.linear(hidden, weight).float() / temperature, -1)  # the old bf16 logits
    rounded = rounded.gather(1, tokens[:, None])[:, 0].double()
    gap_now = (behaviour - trainer.double()).abs().max().item()
    gap_before = (rounded - trainer.double()).abs().max().item()
    assert hidden.shape[0] == 6 * 12
    print(f"\nT={temperature}: max gap behaviour-trainer now {gap_now:.2e}, with bf16-rounded logits {gap_before:.2e}")
    assert gap_now <= 1e-5 and (behaviour - exact).abs().max() <= 1e-5
    assert gap_before >= 1e-3 and gap_before >= 100 * gap_now, (gap_before, gap_now)


@pytest.mark.parametrize("tie", [False, True])
def test_sampled_logits_follow_in_place_weight_updates(tmp_path, tie):
    """The fp32 copy of a bf16 LM head is remade when the weight changes in place (a load)."""
    make_hf("qwen2", seed=4, tie=tie).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.bfloat16)
    head = SampledLogits(model)
    h = torch.randn(5, model.args.hidden_size).to(torch.bfloat16)
    for _ in range(2):
        got = head(h)
        want = model.compute_logits(h)  # the upcast product
        assert got.dtype == torch.float32 and (got - want).abs().max() <= 1e-5
        assert not torch.equal(got, F.linear(h, model.lm_head_weight).float())  # not bf16-rounded
        with torch.no_grad():
            model.lm_head_weight.copy_(model.lm_head_weight * -2)  # what load_weights does
    assert torch.allclose(head(h), model.compute_logits(h), atol=1e-5)
