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
    outs = eng.generate([Request(i, p, SamplingParams(temperature=0, max_new_tokens=10)) for i, p in enumerate(prompts)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=dev), attention_mask=torch.ones(1, len(p), dtype=torch.long, device=dev),
                              max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0)
        assert o.output_ids == ref[0, len(p):].tolist()
        ids = torch.tensor(p + o.output_ids, device=dev)
        cu = cu_seqlens_from_lengths([len(ids)], device=dev)
        with torch.no_grad():
            lg = model.compute_logits(model(ids, packed_positions(cu), PackedAttention(cu, backend="sdpa")))
        lp = torch.log_softmax(lg[len(p) - 1:-1].float(), -1).gather(1, ids[len(p):, None])[:, 0].cpu()
        assert (torch.tensor(o.logprobs) - lp).abs().max() <= 1e-4


def test_cuda_bf16_sampled_run_frees_the_cache(folder):
    model = load_model(folder, dtype=torch.bfloat16, device=torch.device("cuda"))
    eng = BuiltinEngine(model, max_kv_tokens=2048, block_size=16, max_model_len=256)
    reqs = [Request(i, [5 + i, 9, 13], SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, seed=i))
            for i in range(16)]
    outs = eng.generate(reqs)
    assert all(1 <= len(o.output_ids) <= 24 and all(lp <= 0 for lp in o.logprobs) for o in outs)
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
