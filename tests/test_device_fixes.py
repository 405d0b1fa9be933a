"""Defects found by reading the code a first GPU run executes (issue 36), each checked on CPU through
the code path the GPU runs:

- the checkpoint snapshot is one exact-size host arena reused across saves (pinned by registering
  it on CUDA, never tensor by tensor through the caching host allocator);
- a decode step's index arrays and the sampler's per-row parameters reach the device in one
  non-blocking copy from a pinned staging buffer (no ``torch.tensor(list, device=)``);
- a CUDA-graph replay refreshes the fp32 LM head after a pull; an engine with decode graphs frees its
  KV cache when dropped (no reference cycle);
- the masked prefill broadcasts one [n, L] mask over the heads (no per-head copy);
- the memory plan counts the fp32 dW fallback, the graph pool and remote pullers' NCCL groups.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from staleflow.model import CausalLM, ModelArgs
from staleflow.rollout import BuiltinEngine, Request, SamplingParams
from staleflow.rollout.cuda_graphs import DecodeGraphs
from staleflow.train.checkpoint_writer import ARENA_ALIGN, HostArena

ARGS = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
OPTS = dict(max_running=4, max_kv_tokens=256, block_size=4, prefill_chunk_tokens=6, max_model_len=48)


def _model(seed: int = 0, dtype=torch.float32) -> CausalLM:
    return CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.2, seed=seed).to(dtype)


def _requests(n_new: int = 6, temperature: float = 1.0, top_p: float = 1.0):
    prompts = [list(range(2, 9)), list(range(10, 13)), list(range(20, 31))]
    return [
        Request(i, p, SamplingParams(temperature=temperature if i else 0.0, max_new_tokens=n_new, top_p=top_p, seed=i))
        for i, p in enumerate(prompts)
    ]


# ---- the checkpoint snapshot: one pinned arena --------------------------------------------------
class _Pins:
    def __init__(self):
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[int] = []

    def pin(self, buf):
        self.pinned.append((buf.data_ptr(), buf.numel()))

    def unpin(self, buf):
        self.unpinned.append(buf.data_ptr())


def _cuda_like(items):
    """Tensors that report is_cuda (the snapshot then pins), backed by CPU storage."""

    class Fake(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    return [(n, t.as_subclass(Fake)) for n, t in items]


def test_pinned_arena_is_one_exact_size_buffer_reused_across_saves():
    g = torch.Generator().manual_seed(0)
    items = [
        ("w", torch.randn(37, 5, generator=g)),
        ("b", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("mask", torch.rand(9, generator=g) > 0.5),
        ("empty", torch.empty(0, 4)),
    ]
    pins = _Pins()
    arena = HostArena(pins.pin, pins.unpin)
    snap = arena.snapshot(_cuda_like(items))
    exact = sum(t.numel() * t.element_size() for _, t in items)
    assert len(pins.pinned) == 1 and arena.pinned  # ONE registration, of the arena's exact bytes
    assert exact <= pins.pinned[0][1] == arena.buf.numel() < exact + ARENA_ALIGN * len(items)
    for (name, t), (name2, h) in zip(items, snap):
        assert name == name2 and h.dtype == t.dtype and torch.equal(h, t)
        assert h.data_ptr() % ARENA_ALIGN == 0 and h.untyped_storage().data_ptr() == arena.buf.data_ptr()
    ptr = arena.buf.data_ptr()
    items[0][1].add_(1.0)  # the next save: same shapes, new values
    snap = arena.snapshot(_cuda_like(items))
    assert len(pins.pinned) == 1 and arena.allocations == 1 and arena.buf.data_ptr() == ptr  # reused
    assert torch.equal(snap[0][1], items[0][1])
    arena.snapshot(_cuda_like(items + [("new", torch.zeros(100))]))  # the state grew: a new arena
    assert pins.unpinned == [ptr] and len(pins.pinned) == 2 and arena.allocations == 2
    arena.release()
    assert len(pins.unpinned) == 2


def test_pinned_arena_stays_pageable_on_cpu_and_when_pinning_fails():
    items = [("a", torch.arange(6.0))]
    pins = _Pins()
    arena = HostArena(pins.pin, pins.unpin)
    assert torch.equal(arena.snapshot(items)[0][1], items[0][1]) and pins.pinned == [] and not arena.pinned

    def refuse(buf):
        raise RuntimeError("cudaErrorMemoryAllocation")

    arena = HostArena(refuse, pins.unpin)
    out = arena.snapshot(_cuda_like(items))
    assert not arena.pinned and "cudaErrorMemoryAllocation" in arena.pin_error and torch.equal(out[0][1], items[0][1])
    arena.snapshot(_cuda_like(items))
    assert arena.allocations == 1  # no retry per save


def test_pinned_checkpoint_writer_snapshots_into_its_arena(tmp_path):
    """begin_save copies the state into the writer's arena (one buffer), and the saved file holds it."""
    from safetensors.torch import load_file

    from staleflow.train.checkpoint import begin_save, finish_save
    from staleflow.train.checkpoint_writer import CheckpointWriter

    tiny = CausalLM(ModelArgs(**ARGS)).init_weights(std=0.02, seed=0)
    from staleflow.config import TrainConfig
    from staleflow.train.trainer import Trainer

    trainer = Trainer(tiny, TrainConfig(lr=1e-3, micro_batch_tokens=256), "cpu", max_response_tokens=16)
    writer = CheckpointWriter()
    final, writer = begin_save(trainer, tmp_path, writer=writer)
    finish_save(trainer, writer, final)
    arena = writer.buffers
    assert isinstance(arena, HostArena) and arena.allocations == 1 and not arena.pinned
    saved = load_file(str(final / "rank_0.safetensors"))
    name = next(n for n in saved if n.endswith("embed_tokens.weight"))
    assert torch.equal(saved[name], dict(trainer.model.named_parameters())["model.embed_tokens.weight"].detach())
    final, writer = begin_save(trainer, tmp_path, writer=writer)
    finish_save(trainer, writer, final)
    assert arena.allocations == 1  # the second save reused it


# ---- one host-to-device copy per step ------------------------------------------------------------
def test_pinned_staging_one_upload_per_step_and_no_tensor_from_a_list_on_the_device(monkeypatch):
    """Every decode / prefill step sends its index arrays in ONE copy (the runner's staging) and the
    sampler its per-row parameters in one more; nothing builds a device tensor from a Python list."""
    eng = BuiltinEngine(_model(), decode_backend="gather", **OPTS)
    for r in _requests(top_p=0.9):  # greedy, plain and truncated rows together
        eng.add(r)
    orig = torch.tensor
    on_device = []

    def spy(data, *a, **k):
        if k.get("device") is not None:
            on_device.append(k["device"])
        return orig(data, *a, **k)

    monkeypatch.setattr(torch, "tensor", spy)
    steps = 0
    while eng.has_unfinished():
        runner_before, sampler_before = eng.runner.staging.uploads, getattr(eng.sampler.staging, "uploads", 0)
        eng.step()
        steps += 1
        assert eng.runner.staging.uploads - runner_before == 1
        assert getattr(eng.sampler.staging, "uploads", 0) - sampler_before <= 1
    assert steps > 6 and on_device == []


def test_pinned_staging_outputs_match_an_engine_without_it(monkeypatch):
    """The staged step gives the tokens and log-probs of the same step built tensor by tensor."""
    from staleflow.rollout import staging

    a = BuiltinEngine(_model(), decode_backend="gather", **OPTS).generate(_requests(top_p=0.8))

    class Plain(staging.HostStaging):  # what the step did before: one tensor per array
        def upload(self, parts):
            self.uploads += 1
            return [torch.as_tensor(__import__("numpy").asarray(p).reshape(-1), dtype=self.dtype) for p in parts]

    monkeypatch.setattr("staleflow.rollout.model_runner.HostStaging", Plain)
    monkeypatch.setattr("staleflow.rollout.sampler.HostStaging", Plain)
    b = BuiltinEngine(_model(), decode_backend="gather", **OPTS).generate(_requests(top_p=0.8))
    for x, y in zip(a, b):
        assert (
            x.tokens.response_ids == y.tokens.response_ids
            and x.tokens.behaviour_logprobs == y.tokens.behaviour_logprobs
        )


# ---- CUDA graphs: the fp32 LM head after a pull, no reference cycle ------------------------------
class _Recorded:
    """What a captured graph replays: the recorded kernels only (here: the LM-head product of the
    captured hidden state), never SampledLogits' Python."""

    def __init__(self, out, hidden, sampled):
        self.out, self.hidden, self.sampled = out, hidden, sampled

    def replay(self):
        self.out.copy_(F.linear(self.hidden.float(), self.sampled._w32))


def test_cuda_graphs_replay_refreshes_the_fp32_lm_head_after_a_pull():
    """Where torch.mm(out_dtype=) is missing the logits come from an fp32 copy of the LM head; a replay
    after an in-place weight load must use the new head, not the copy made at capture."""
    eng = BuiltinEngine(_model(dtype=torch.bfloat16), decode_backend="gather", **OPTS)
    runner = eng.runner
    graphs = DecodeGraphs(runner, 4, OPTS["max_model_len"], replay=False)
    graphs.replay, graphs.captured = True, True  # as after capture(), with a recorded stand-in below
    hidden = torch.randn(4, ARGS["hidden_size"]).to(torch.bfloat16)
    runner.sampled_logits(hidden)  # the warm-up before capture made the fp32 copy
    graphs.logits[4] = torch.empty(4, ARGS["vocab_size"])
    graphs.graphs[4] = _Recorded(graphs.logits[4], hidden, runner.sampled_logits)
    seqs = [SimpleNamespace(num_computed=2, token_at=[5, 6, 7].__getitem__, block_table=[0]) for _ in range(3)]
    before = graphs.run(seqs, lambda s, p: p).clone()
    new = _model(seed=9, dtype=torch.bfloat16)
    eng.load_weights(dict(new.named_parameters()), version=1, keep_kv=False)  # a pull: in place
    after = graphs.run(seqs, lambda s, p: p)
    want = F.linear(hidden.float(), new.lm_head_weight.float())[:3]
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, want, rtol=0, atol=0)


def test_cuda_graphs_engine_frees_its_kv_cache_without_a_garbage_collection():
    gc.disable()
    try:
        eng = BuiltinEngine(_model(), decode_backend="gather", **OPTS)
        eng.runner.graphs = DecodeGraphs(eng.runner, 4, OPTS["max_model_len"], replay=False)
        kv = weakref.ref(eng.runner.attn.k_cache)
        static = weakref.ref(eng.runner.graphs.dev64)
        del eng
        assert kv() is None and static() is None  # freed by reference counting: no cycle holds them
    finally:
        gc.enable()


# ---- masked prefill: one broadcast mask ------------------------------------------------------------
def test_cuda_graphs_masked_prefill_broadcasts_one_mask_over_the_heads(monkeypatch):
    from staleflow.rollout import paged_attention

    n, L, D, heads, kv = 5, 12, 16, 8, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(heads, n, D, generator=g)
    k, v = torch.randn(kv, L, D, generator=g), torch.randn(kv, L, D, generator=g)
    mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)
    seen = []
    orig = F.scaled_dot_product_attention

    def spy(q_, k_, v_, attn_mask=None, **kw):
        seen.append((attn_mask, k_))
        return orig(q_, k_, v_, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(paged_attention.F, "scaled_dot_product_attention", spy)
    stacked = paged_attention.prefill_sdpa(q, k, v, mask, stack_groups=True)
    m, kk = seen[-1]
    assert m.data_ptr() == mask.data_ptr() and m.stride()[:2] == (0, 0) or m.shape[:2] == (1, 1)
    assert kk.data_ptr() == k.data_ptr() and kk.stride(0) == 0  # K/V expanded, not repeated
    plain = paged_attention.prefill_sdpa(q, k, v, mask, stack_groups=False)
    torch.testing.assert_close(stacked, plain, rtol=1e-5, atol=1e-5)


# ---- the memory plan ------------------------------------------------------------------------------
def test_cuda_graphs_plan_counts_the_pool_the_fp32_dw_fallback_and_remote_pullers():
    import dataclasses

    from staleflow.plan import build_plan
    from staleflow.plan.estimate import NCCL_BYTES, NCCL_PULL_BYTES, PRIMARY_CONTEXT_BYTES
    from staleflow.plan.transients import cuda_graph_pool_bytes, logprob_backward_bytes
    from staleflow.presets import preset_gpu_7b
    from staleflow.rollout.cuda_graphs import buckets_for

    cfg = preset_gpu_7b()
    base = build_plan(cfg, nproc=8, gpu_bytes=80 << 30, flash=False)
    assert base.fits
    trainer, rollout = base.ranks[0], base.ranks[-1]
    V, H = 152064, 3584
    # no CUDA here: the plan cannot know addmm(out_dtype=, out=) accumulates in place, so it counts
    # the fallback's fp32 [V, H] product (not a bf16 one)
    assert trainer.items["logprob_bwd"] == logprob_backward_bytes(
        16384, H, V, torch.bfloat16, inplace_fp32_accumulate=False
    )
    assert trainer.items["logprob_bwd"] - logprob_backward_bytes(16384, H, V, torch.bfloat16) == V * H * 2
    assert "graphs" not in rollout.items and any("cuda-graphs off" in n for n in rollout.notes)
    graphs = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, cuda_graphs=True))
    plan = build_plan(graphs, nproc=8, gpu_bytes=80 << 30, flash=False)
    pool = plan.ranks[-1].items["graphs"]
    args = SimpleNamespace(hidden_size=H, head_dim=128, num_heads=28, num_kv_heads=4, intermediate_size=18944,
                           vocab_size=V)  # fmt: skip
    assert pool == cuda_graph_pool_bytes(args, graphs.rollout, 2)
    assert pool > sum(buckets_for(128)) * V * 4  # every bucket's fp32 logits stay live
    assert plan.fits
    # two nodes of 8: trainer ranks 0-7 on node 0, the 8 rollout ranks on node 1 pull over NCCL, so
    # every trainer rank holds 8 pull groups and no IPC context; each puller holds its own group
    two = build_plan(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, ranks=8)), 16, 80 << 30,
                     flash=False, nodes=2)  # fmt: skip
    remote = [rp for rp in two.ranks if rp.role == "rollout"]
    assert [rp.gpu for rp in remote] == list(range(8, 16))
    assert two.ranks[0].items["contexts"] == PRIMARY_CONTEXT_BYTES + NCCL_BYTES + 8 * NCCL_PULL_BYTES
    assert all(rp.items["contexts"] == PRIMARY_CONTEXT_BYTES + NCCL_PULL_BYTES for rp in remote)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pinned_arena_registers_and_copies_asynchronously_on_gpu():
    t = torch.randn(1000, 17, device="cuda")
    arena = HostArena()
    ((_, h),) = arena.snapshot([("t", t)])
    torch.cuda.synchronize()
    assert arena.pinned and h.is_pinned() and torch.equal(h, t.cpu())
    arena.release()
