"""Pulls that keep in-flight sequences and their KV (issue 27, item 1).

A weight load with keep_kv leaves running sequences in place: the K/V already computed with the
old weights stay in the cache, the next tokens come from the new weights. The behaviour log-prob
recorded for each token must be the one of the computation that sampled it, and its version the
weights of that computation. The reference here recomputes every token independently:
- tokens stamped with the old version: a plain forward of the old model;
- tokens stamped with the new version: a forward of the new model whose attention reads, for the
  positions whose K/V the engine had computed before the load, the OLD model's K/V (recorded by a
  forward of the old model), and its own K/V for the later positions: exactly the mixed cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from staleflow.config import CoordinatorConfig
from staleflow.coordinator.types import Pull
from staleflow.model import CausalLM, ModelArgs
from staleflow.rollout import BuiltinEngine, Request, SamplingParams
from staleflow.workers.rollout import keeps_kv_on_pull

ARGS = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _causal(q, k, v):
    """q [T, H, D], k, v [T, Hkv, D] -> [T, H, D] causal attention in fp64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(), is_causal=True
    )
    return out.transpose(0, 1).to(q.dtype)


class Recording:
    """Plain causal attention that keeps each layer's k, v."""

    def __init__(self):
        self.kv = {}

    def __call__(self, layer, q, k, v):
        self.kv[layer] = (k.clone(), v.clone())
        return _causal(q, k, v)


class Mixed:
    """Causal attention whose first ``cut`` positions use recorded (old-weight) K/V."""

    def __init__(self, old_kv, cut: int):
        self.old_kv, self.cut = old_kv, cut

    def __call__(self, layer, q, k, v):
        ok, ov = self.old_kv[layer]
        c = self.cut
        k = torch.cat([ok[:c], k[c:]])
        v = torch.cat([ov[:c], v[c:]])
        return _causal(q, k, v)


def _logprobs(model, tokens, attn):
    """log p(tokens[i + 1] | tokens[: i + 1]) for every i, fp64 logits."""
    ids = torch.tensor(tokens)
    with torch.no_grad():
        hidden = model(ids, torch.arange(len(tokens)), attn)
        logits = F.linear(hidden.double(), model.lm_head_weight.double())
    return torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]


def _models():
    old = CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.2, seed=0)
    new = CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.2, seed=1)
    return old, new


@pytest.mark.parametrize("backend", ["mirror", "gather"])
def test_keep_kv_pull_continues_sequences_with_new_weights_and_per_token_logprobs(backend):
    old, new = _models()
    engine_model = CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.2, seed=0)
    eng = BuiltinEngine(
        engine_model, max_kv_tokens=512, block_size=4, prefill_chunk_tokens=64, max_model_len=64, decode_backend=backend
    )
    prompts = {0: list(range(2, 12)), 1: list(range(20, 27))}
    for rid, p in prompts.items():
        eng.add(Request(rid, p, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=rid)))
    for _ in range(5):
        assert eng.step() == []
    cut = {rid: eng.seqs[rid].num_computed for rid in prompts}  # tokens whose K/V the old weights computed
    n_old = {rid: eng.seqs[rid].num_output for rid in prompts}
    eng.load_weights(dict(new.named_parameters()), version=1, keep_kv=True)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert sorted(outs) == [0, 1]
    for rid, p in prompts.items():
        o = outs[rid]
        k = n_old[rid]
        assert o.tokens.versions == [0] * k + [1] * (12 - k), "tokens before the pull keep version 0, the rest carry 1"
        tokens = p + o.tokens.response_ids
        got = torch.tensor(o.tokens.behaviour_logprobs, dtype=torch.float64)
        want_old = _logprobs(old, tokens, Recording())[len(p) - 1 :]
        rec = Recording()
        _logprobs(old, tokens, rec)
        want_mixed = _logprobs(new, tokens, Mixed(rec.kv, cut[rid]))[len(p) - 1 :]
        want_new = _logprobs(new, tokens, Recording())[len(p) - 1 :]
        torch.testing.assert_close(got[:k], want_old[:k], atol=2e-5, rtol=0)
        torch.testing.assert_close(got[k:], want_mixed[k:], atol=2e-5, rtol=0)
        # the reference can tell: old-weight K/V really were kept (a re-prefill gives want_new)
        assert (want_mixed[k:] - want_new[k:]).abs().max() > 1e-3
        assert (want_old[k:] - want_new[k:]).abs().max() > 1e-3


def test_keep_kv_pull_without_keep_recomputes_kv_with_new_weights():
    """The contrast: a load without keep_kv re-prefills, so post-pull tokens match the new model alone."""
    old, new = _models()
    eng = BuiltinEngine(
        CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.2, seed=0),
        max_kv_tokens=512,
        block_size=4,
        prefill_chunk_tokens=64,
        max_model_len=64,
    )
    p = list(range(2, 12))
    eng.add(Request(0, p, SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=3)))
    for _ in range(4):
        eng.step()
    k = eng.seqs[0].num_output
    eng.load_weights(dict(new.named_parameters()), version=1, keep_kv=False)
    (o,) = [o for _ in range(40) for o in eng.step()][:1]
    got = torch.tensor(o.tokens.behaviour_logprobs, dtype=torch.float64)
    want_new = _logprobs(new, p + o.tokens.response_ids, Recording())[len(p) - 1 :]
    torch.testing.assert_close(got[k:], want_new[k:], atol=2e-5, rtol=0)
    assert o.tokens.versions == [0] * k + [1] * (10 - k)


@pytest.mark.parametrize(
    "interrupt,keep,expected", [(True, False, False), (True, True, True), (False, False, True), (False, True, True)]
)
def test_keep_kv_rank_keeps_sequences_when_the_coordinator_allows(interrupt, keep, expected):
    """The rank keeps its sequences on a Pull exactly when the coordinator interrupts nothing before it."""
    cfg = CoordinatorConfig(interrupt_on_pull=interrupt, keep_kv_on_pull=keep)
    assert keeps_kv_on_pull(cfg) is expected


def test_keep_kv_rank_pull_with_keep_kv_on_pull_interrupts_nothing():
    """The runtime rank, --coordinator.keep-kv-on-pull: the Pull loads with keep_kv=True, nothing is
    aborted or reported partial, and the sequences finish with tokens of both versions."""
    from staleflow.cluster.roles import Roles
    from staleflow.workers.rollout import RolloutWorker

    old, new = _models()
    eng = BuiltinEngine(
        CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.2, seed=0),
        max_kv_tokens=512,
        block_size=4,
        prefill_chunk_tokens=64,
        max_model_len=64,
    )
    loads = []

    class Source:
        def load(self, engine, keep_kv):
            loads.append(keep_kv)
            engine.load_weights(dict(new.named_parameters()), 1, keep_kv=keep_kv)
            return 1, 64, {0: 64}  # (version, bytes, {source node: bytes})

    sent = []
    w = RolloutWorker.__new__(RolloutWorker)
    w.engine, w.weights, w.instance = eng, Source(), 0
    w.keep_on_pull = keeps_kv_on_pull(CoordinatorConfig(interrupt_on_pull=True, keep_kv_on_pull=True))
    w.unsent, w.net = [], None  # one node
    w.ctx = type(
        "Ctx",
        (),
        {
            "client": type("C", (), {"send": staticmethod(sent.append)})(),
            "roles": Roles(3, 2),
            "rank": 1,
            "run_id": "x",
        },
    )()
    eng.add(Request(5, list(range(2, 10)), SamplingParams(max_new_tokens=8, ignore_eos=True, seed=5)))
    for _ in range(3):
        eng.step()
    w.pull(Pull(0, 1))
    assert loads == [True]
    assert [type(m).__name__ for m in sent] == ["Pulled"]  # no Finished(partial): nothing was interrupted
    assert eng.stats().running_ids == [5]
    outs = [o for _ in range(20) for o in eng.step()]
    assert outs and set(outs[0].tokens.versions) == {0, 1}
