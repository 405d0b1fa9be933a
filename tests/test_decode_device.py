"""Decode without per-step host work (issue 27, item 2).

- masks are built on the device, never built on the host and copied;
- a decode step moves its tokens and log-probs to the host in ONE transfer, nothing else;
- --rollout.cuda-graphs: the static-buffer decode step that is captured gives the eager step's
  logits (run here without capture, through the Triton kernel's interpreter), and a CPU engine with
  the flag is refused with a one-line error.
"""

from __future__ import annotations

import os

import pytest
import torch

from staleflow.config import ModelConfig, RolloutConfig
from staleflow.model import CausalLM, ModelArgs
from staleflow.rollout import BuiltinEngine, EngineError, Request, SamplingParams
from staleflow.rollout.cuda_graphs import DecodeGraphs, buckets_for
from staleflow.rollout.sampler import truncation_mask, truncation_mask_sorted

ARGS = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def _model(seed: int = 0) -> CausalLM:
    return CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.2, seed=seed)


def _engine(**kw) -> BuiltinEngine:
    opts = dict(max_running=4, max_kv_tokens=256, block_size=4, prefill_chunk_tokens=6, max_model_len=48)
    return BuiltinEngine(_model(), **{**opts, **kw})


def _requests(n_new: int = 6, temperature: float = 1.0):
    prompts = [list(range(2, 9)), list(range(10, 13)), list(range(20, 31))]
    return [
        Request(i, p, SamplingParams(temperature=temperature, max_new_tokens=n_new, ignore_eos=True, seed=i))
        for i, p in enumerate(prompts)
    ]


def test_decode_device_cuda_graphs_on_cpu_is_a_one_line_error():
    with pytest.raises(EngineError, match=r"^--rollout.cuda-graphs needs the rollout engine on a CUDA device") as e:
        _engine(cuda_graphs=True)
    assert "\n" not in str(e.value)
    with pytest.raises(EngineError, match="drop the flag"):
        BuiltinEngine.from_config(ModelConfig(), RolloutConfig(cuda_graphs=True), model=_model())
    assert RolloutConfig().cuda_graphs is False  # off by default


def test_decode_device_buckets_cover_every_batch_size():
    for max_batch in (1, 3, 64, 100, 512):
        bs = buckets_for(max_batch)
        assert bs == sorted(bs) and bs[-1] == max_batch
        assert all(any(b >= n for b in bs) for n in range(1, max_batch + 1))


class _Counter:
    def __init__(self, monkeypatch):
        self.calls: dict[str, int] = {}
        for name in ("tolist", "item", "cpu", "numpy"):
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, _name=name, **k):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)
        orig_to = torch.Tensor.to

        def to(t, *a, **k):  # a bool tensor sent to a device (dtype casts on the device do not count)
            if t.dtype == torch.bool and ("device" in k or any(isinstance(x, (str, torch.device)) for x in a)):
                self.calls["bool.to"] = self.calls.get("bool.to", 0) + 1
            return orig_to(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, "to", to)


@pytest.mark.parametrize("backend", ["mirror", "gather"])
def test_decode_device_one_transfer_per_step_and_no_host_masks(monkeypatch, backend):
    eng = _engine(decode_backend=backend)
    for r in _requests():
        eng.add(r)
    counter = _Counter(monkeypatch)
    steps = 0
    decode_only = 0
    while eng.has_unfinished():
        before = dict(counter.calls)
        batch_has_prefill = any(s.num_computed < len(s) - 1 for s in eng.scheduler.running)
        eng.step()
        steps += 1
        got = {k: v - before.get(k, 0) for k, v in counter.calls.items() if v - before.get(k, 0)}
        assert got.get("bool.to", 0) == 0, "a mask was built on the host and copied"
        assert got.get("item", 0) == 0 and got.get("cpu", 0) == 0
        assert got.get("tolist", 0) <= 1, f"step {steps}: {got}"
        decode_only += not batch_has_prefill
    assert steps > 6 and decode_only >= 3  # chunked prefills (with cached context) and pure decodes ran


def test_decode_device_sort_based_truncation_matches_the_bucket_search():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(12, 300, generator=g) * 3, -1)
    top_k = torch.tensor([0, 1, 5, 70, 0, 0, 3, 200, 0, 10, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.3, 0.999, 1.0, 0.8, 0.05, 0.7, 1.0, 0.6], dtype=torch.float64)
    assert torch.equal(truncation_mask_sorted(probs, top_k, top_p), truncation_mask(probs, top_k, top_p))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton decode kernel needs TRITON_INTERPRET=1 on CPU"
)
def test_decode_device_static_buffer_step_matches_the_eager_step():
    """What --rollout.cuda-graphs captures (static buffers, padded bucket, grid sized for
    max_model_len) run eagerly gives the eager engine's tokens and log-probs."""
    pytest.importorskip("triton")
    eager, staged = _engine(decode_backend="triton"), _engine(decode_backend="triton")
    staged.runner.graphs = DecodeGraphs(staged.runner, 4, staged.max_model_len, replay=False)
    used = []
    run = staged.runner.graphs.run

    def spy(seqs, slot_of):
        used.append(len(seqs))
        return run(seqs, slot_of)

    staged.runner.graphs.run = spy
    a, b = eager.generate(_requests()), staged.generate(_requests())
    assert used and 3 in used  # three sequences decoded together, padded to bucket 4
    for x, y in zip(a, b):
        assert x.tokens.response_ids == y.tokens.response_ids
        torch.testing.assert_close(
            torch.tensor(x.tokens.behaviour_logprobs), torch.tensor(y.tokens.behaviour_logprobs), atol=1e-5, rtol=0
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_device_cuda_graph_replay_matches_the_eager_engine_on_gpu():
    """On a GPU: replayed decode steps give the eager engine's tokens and log-probs, graphs are
    captured once per bucket, and survive an in-place weight load (a pull)."""
    pytest.importorskip("triton")
    dev = torch.device("cuda")

    def engine(graphs: bool) -> BuiltinEngine:
        opts = dict(max_running=4, max_kv_tokens=256, block_size=4, prefill_chunk_tokens=6, max_model_len=48)
        return BuiltinEngine(_model().to(dev), decode_backend="triton", cuda_graphs=graphs, **opts)

    eager, graphed = engine(False), engine(True)
    outs = {}
    for eng in (eager, graphed):  # greedy: a last-bit difference between batch sizes cannot flip a draw
        first = eng.generate(_requests(temperature=0.0))
        eng.load_weights(dict(_model(seed=5).to(dev).named_parameters()), version=1, keep_kv=False)
        outs[eng] = first + eng.generate(_requests(temperature=0.0))
    assert graphed.runner.graphs.captured and sorted(graphed.runner.graphs.graphs) == [1, 2, 4]
    for x, y in zip(outs[eager], outs[graphed]):
        assert x.tokens.response_ids == y.tokens.response_ids and x.tokens.versions == y.tokens.versions
        torch.testing.assert_close(
            torch.tensor(x.tokens.behaviour_logprobs), torch.tensor(y.tokens.behaviour_logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_decode_device_one_synchronisation_per_decode_step_on_gpu():
    """On a GPU a pure decode step waits for the device once (its tokens and log-probs coming back):
    the step's index arrays and the sampler's parameters go up from pinned staging buffers without a
    wait (torch.cuda.set_sync_debug_mode counts every synchronising call)."""
    import warnings

    dev = torch.device("cuda")
    eng = BuiltinEngine(_model().to(dev), max_running=4, max_kv_tokens=256, block_size=4, prefill_chunk_tokens=64,
                        max_model_len=48)  # fmt: skip
    eng.generate(_requests(n_new=4))  # warm-up: kernels, staging buffers
    for r in _requests(n_new=12):
        eng.add(r)
    eng.step()  # the prefills (whole prompts in one chunk)
    eng.step()
    counts = []
    for _ in range(4):  # pure decode steps
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
    assert counts == [1, 1, 1, 1], counts
