"""Decode backends of the built-in engine (rollout/decode_backend.py) and its prefill GQA path.

- The Triton paged decode kernel wired into the engine (run here under TRITON_INTERPRET=1, set by
  conftest) gives the same tokens and log-probs as the gather path through continuous batching,
  preemption, aborts, resumes and a weight load.
- The flash-attn call is checked against a stand-in `flash_attn` module that implements
  `flash_attn_with_kvcache` as its docstring specifies (paged cache [num_blocks,
  page_block_size, Hkv, D] with page_block_size a multiple of 256, int32 block_table and
  cache_seqlens, q [B, 1, Hq, D]): this verifies our arguments, not flash-attn (no GPU here).
- Backend selection in one place: what "auto" picks per device / dtype / block size, and one-line
  errors for an explicit backend that cannot run.
- The CUDA prefill path for masked chunks (G query heads stacked as rows of their kv head)
  equals repeating K/V.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from test_engine import engine, make_hf, prompts

from staleflow.model import load_model
from staleflow.rollout import EngineError, Request, SamplingParams
from staleflow.rollout import decode_backend as db
from staleflow.rollout.paged_attention import prefill_sdpa

triton_here = pytest.mark.skipif(
    not db.triton_available(torch.device("cpu")), reason="needs triton and TRITON_INTERPRET=1 set before import"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for kind, seed in (("llama", 0), ("llama-new", 11)):
        folder = tmp_path_factory.mktemp(kind)
        make_hf("llama", seed=seed).save_pretrained(folder)
        out[kind] = str(folder)
    return out


def run_with_churn(eng, reqs, new_state, check=None):
    """Step to completion; abort + resume two running requests at step 4, load weights at step 9."""
    for r in reqs:
        eng.add(r)
    outs = {}
    step = 0
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
        step += 1
        if step == 4:
            for o in eng.abort([s.request_id for s in eng.scheduler.running[:2]]):
                eng.add(Request(o.request_id, o.tokens, reqs[o.request_id].params))
        if step == 9:
            eng.load_weights(new_state, version=1)
        if check is not None:
            check(eng)
    return outs


def churn_requests(n=8):
    return [
        Request(
            i,
            p,
            SamplingParams(
                temperature=1.0 if i % 2 else 0, max_new_tokens=int(6 + 4 * (i % 5)), ignore_eos=True, seed=i
            ),
        )
        for i, p in enumerate(prompts(n, lo=3, hi=24, seed=21))
    ]


def assert_same_outputs(a, b, n):
    assert a.keys() == b.keys() == set(range(n))
    for i in range(n):
        assert a[i].tokens.response_ids == b[i].tokens.response_ids and a[i].tokens.versions == b[i].tokens.versions
        assert max(abs(x - y) for x, y in zip(a[i].tokens.behaviour_logprobs, b[i].tokens.behaviour_logprobs)) <= 1e-5


@triton_here
def test_triton_decode_equals_gather_under_churn(folders):
    new_state = dict(load_model(folders["llama-new"]).state_dict())
    reqs = churn_requests()
    kw = dict(max_kv_tokens=64, max_model_len=48, max_running=5)
    tri = engine(folders["llama"], decode_backend="triton", **kw)
    gat = engine(folders["llama"], decode_backend="gather", **kw)
    assert (tri.runner.backend, gat.runner.backend, tri.runner.mirror) == ("triton", "gather", None)
    outs = [run_with_churn(e, reqs, new_state) for e in (tri, gat)]
    assert tri.scheduler.num_preemptions > 0
    assert_same_outputs(*outs, len(reqs))
    assert tri.block_manager.num_free == tri.block_manager.num_blocks


def _fake_flash_module(calls):
    """flash_attn.flash_attn_with_kvcache as documented, in plain torch (fp32 math)."""

    def flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        cache_seqlens=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        **unused,
    ):
        num_blocks, page, n_kv, d = k_cache.shape
        assert page % 256 == 0, "page_block_size must be a multiple of 256"
        assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
        assert k is None and v is None and q.dim() == 4 and q.shape[1] == 1
        calls.append(q.shape[0])
        scale = softmax_scale or d**-0.5
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            n = int(cache_seqlens[b])
            pos = torch.arange(n)
            kb = k_cache[block_table[b].long()[pos // page], pos % page].float()  # [n, Hkv, D]
            vb = v_cache[block_table[b].long()[pos // page], pos % page].float()
            group = q.shape[2] // n_kv
            kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)  # [n, Hq, D]
            att = torch.einsum("hd,nhd->hn", q[b, 0].float(), kb) * scale
            out[b, 0] = torch.einsum("hn,nhd->hd", att.softmax(-1), vb).to(q.dtype)
        return out

    return types.SimpleNamespace(flash_attn_with_kvcache=flash_attn_with_kvcache)


@triton_here
def test_flash_call_follows_the_documented_paged_layout(folders, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(calls))
    reqs = churn_requests(6)
    kw = dict(block_size=256, max_kv_tokens=2048, max_model_len=60, max_running=6)
    fla = engine(folders["llama"], decode_backend="triton", **kw)
    fla.runner.backend = fla.runner.attn.backend = "flash"  # CPU: the resolver would refuse flash
    ref = engine(folders["llama"], decode_backend="gather", **kw)
    new_state = dict(load_model(folders["llama-new"]).state_dict())
    outs = [run_with_churn(e, reqs, new_state) for e in (fla, ref)]
    assert calls and max(calls) > 1  # decoded batches went through the stand-in
    assert_same_outputs(*outs, len(reqs))


def test_auto_backend_per_device_dtype_and_block_size(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert db.resolve_decode_backend("auto", cpu, torch.float32, 16) == "mirror"
    assert db.resolve_decode_backend("gather", cpu, torch.bfloat16, 16) == "gather"
    monkeypatch.setattr(db, "flash_available", lambda: True)
    monkeypatch.setattr(db, "triton_available", lambda device: True)
    assert db.resolve_decode_backend("auto", cuda, torch.bfloat16, 256) == "flash"
    assert db.resolve_decode_backend("auto", cuda, torch.bfloat16, 16) == "triton"  # flash needs 256-multiples
    assert db.resolve_decode_backend("auto", cuda, torch.float32, 256) == "triton"  # flash needs fp16/bf16
    monkeypatch.setattr(db, "flash_available", lambda: False)
    assert db.resolve_decode_backend("auto", cuda, torch.bfloat16, 256) == "triton"
    monkeypatch.setattr(db, "triton_available", lambda device: False)
    assert db.resolve_decode_backend("auto", cuda, torch.bfloat16, 16) == "gather"
    with pytest.raises(EngineError, match="decode_backend='triton' needs triton"):
        db.resolve_decode_backend("triton", cuda, torch.bfloat16, 16)
    with pytest.raises(EngineError, match="multiple of 256 \\(got 16\\)"):
        db.resolve_decode_backend("flash", cuda, torch.bfloat16, 16)
    with pytest.raises(EngineError, match="decode_backend='paged' is unknown"):
        db.resolve_decode_backend("paged", cpu, torch.float32, 16)


def test_engine_backend_arguments(folders):
    assert engine(folders["llama"]).runner.backend == "mirror"  # CPU default
    assert engine(folders["llama"], decode_mirror=False).runner.backend == "gather"
    with pytest.raises(EngineError, match="decode_backend='flash' needs CUDA"):
        engine(folders["llama"], decode_backend="flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_query_groups_equal_repeated_kv(dtype):
    """The CUDA masked-chunk layout (stack_groups) against the plain repeat_interleave form."""
    g = torch.Generator().manual_seed(0)
    for n_kv, group, n, cached in ((2, 3, 5, 11), (4, 7, 9, 0), (1, 4, 1, 30)):
        q = torch.randn(n, n_kv * group, 16, generator=g).to(dtype).transpose(0, 1)  # [Hq, n, D], strided
        k = torch.randn(n_kv, n + cached, 16, generator=g).to(dtype)
        v = torch.randn(n_kv, n + cached, 16, generator=g).to(dtype)
        mask = torch.arange(n + cached)[None, :] <= torch.arange(cached, cached + n)[:, None]  # [n, L]
        want = F.scaled_dot_product_attention(
            q[None], k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None], attn_mask=mask
        )[0]
        got = prefill_sdpa(q, k, v, mask, stack_groups=True)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert (got.float() - want.float()).abs().max() <= tol
        assert torch.equal(prefill_sdpa(q, k, v, mask), want)  # enable_gqa: bit-identical on CPU
