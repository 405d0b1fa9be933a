"""Built-in engine on CUDA (skipped without a GPU): the same code as on CPU must give the same
greedy tokens as transformers on the GPU, fp32 log-probs within 1e-4 of the trainer forward,
and bf16 must run end to end."""

import pytest
import torch

from staleflow.model import PackedAttention, load_model
from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions
from staleflow.rollout import BuiltinEngine, Request, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from test_engine import make_hf

    out = tmp_path_factory.mktemp("qwen3")
    make_hf("qwen3").save_pretrained(out)
    return str(out)


def test_cuda_greedy_matches_transformers_and_logprobs_match_forward(folder):
    dev = torch.device("cuda")
    model = load_model(folder, dtype=torch.float32, device=dev)
    eng = BuiltinEngine(model, max_kv_tokens=1024, block_size=4, prefill_chunk_tokens=8, max_model_len=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 11, 17)]
    outs = eng.generate(
        [Request(i, p, SamplingParams(temperature=0, max_new_tokens=10)) for i, p in enumerate(prompts)]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p], device=dev),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=dev),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
            )
        assert o.tokens.response_ids == ref[0, len(p) :].tolist()
        ids = torch.tensor(p + o.tokens.response_ids, device=dev)
        cu = cu_seqlens_from_lengths([len(ids)], device=dev)
        with torch.no_grad():
            lg = model.compute_logits(model(ids, packed_positions(cu), PackedAttention(cu, backend="sdpa")))
        lp = torch.log_softmax(lg[len(p) - 1 : -1].float(), -1).gather(1, ids[len(p) :, None])[:, 0].cpu()
        assert (torch.tensor(o.tokens.behaviour_logprobs) - lp).abs().max() <= 1e-4


def test_cuda_bf16_sampled_run_frees_the_cache(folder):
    model = load_model(folder, dtype=torch.bfloat16, device=torch.device("cuda"))
    eng = BuiltinEngine(model, max_kv_tokens=2048, block_size=16, max_model_len=256)
    reqs = [
        Request(i, [5 + i, 9, 13], SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, seed=i))
        for i in range(16)
    ]
    outs = eng.generate(reqs)
    assert all(
        1 <= len(o.tokens.response_ids) <= 24 and all(lp <= 0 for lp in o.tokens.behaviour_logprobs) for o in outs
    )
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_cuda_auto_backend_is_a_paged_kernel_and_equals_gather(folder):
    """On CUDA "auto" reads the paged cache in place (flash-attn with 256-token blocks when
    installed, else the Triton kernel); fp32 outputs equal the gather path's through preemption,
    aborts, resumes and a weight load."""
    from test_engine_backends import assert_same_outputs, churn_requests, run_with_churn

    dev = torch.device("cuda")
    kw = dict(max_kv_tokens=64, block_size=4, prefill_chunk_tokens=8, max_model_len=48, max_running=5)
    auto = BuiltinEngine(load_model(folder, dtype=torch.float32, device=dev), **kw)
    gather = BuiltinEngine(load_model(folder, dtype=torch.float32, device=dev), decode_backend="gather", **kw)
    assert auto.runner.backend == "triton"  # fp32 and block 4: flash does not apply
    new_state = {n: p * 0.9 for n, p in load_model(folder, dtype=torch.float32).state_dict().items()}
    reqs = churn_requests()
    assert_same_outputs(*[run_with_churn(e, reqs, new_state) for e in (auto, gather)], len(reqs))


def test_cuda_bf16_engine_samples_from_fp32_logits(folder):
    """bf16 on CUDA: the sampled rows' logits are the fp32 product of the bf16 hidden state and
    LM head (torch.mm with out_dtype=float32, or the cached fp32 head where that is missing)."""
    from staleflow.rollout.model_runner import SampledLogits

    model = load_model(folder, dtype=torch.bfloat16, device=torch.device("cuda"))
    head = SampledLogits(model)
    h = torch.randn(7, model.args.hidden_size, device="cuda").to(torch.bfloat16)
    got = head(h)
    want = h.double() @ model.lm_head_weight.double().t()
    print(f"\nSampledLogits on CUDA: {'mm out_dtype' if head._mm_out_dtype else 'cached fp32 head'}")
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-4
