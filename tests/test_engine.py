"""Built-in rollout engine: exactness vs transformers and the trainer forward, interruption,
KV accounting, batch invariance, in-place weight loads and bad input.

Models are tiny random transformers models (vocab 128, std-0.1 weights so logits are peaked
and greedy ties cannot hide rounding), saved with save_pretrained and loaded with our
load_model. Small block sizes and prefill chunks make every test cross block and chunk
boundaries.
"""

import pytest
import torch

from staleflow.model import PackedAttention, load_model
from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions
from staleflow.rollout import BuiltinEngine, EngineError, Request, SamplingParams

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    eos_token_id=2,
    bos_token_id=1,
)
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_hf(kind: str, seed: int = 0, tie: bool = False):
    cfg_cls, model_cls = (getattr(transformers, n) for n in CLASSES[kind])
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**SHAPE, tie_word_embeddings=tie)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, folder) for llama, qwen2, qwen3."""
    out = {}
    for kind in CLASSES:
        folder = tmp_path_factory.mktemp(kind)
        hf = make_hf(kind)
        hf.save_pretrained(folder)
        out[kind] = (hf, str(folder))
    return out


def engine(folder, **kw):
    kw = {"max_kv_tokens": 1024, "block_size": 4, "prefill_chunk_tokens": 8, "max_model_len": 128, **kw}
    return BuiltinEngine(load_model(folder), **kw)


def prompts(n, lo=3, hi=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 128, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def reference_logprobs(model, prompt, output, temperature=1.0, dtype=torch.float32):
    """The trainer's view: one full-sequence forward, log_softmax(logits / T) of each output token."""
    ids = torch.tensor(prompt + output)
    cu = cu_seqlens_from_lengths([len(ids)])
    m = model.to(dtype)
    with torch.no_grad():
        logits = m.compute_logits(m(ids, packed_positions(cu), PackedAttention(cu)))  # [L, V]
    logits = logits[len(prompt) - 1 : -1].to(dtype)
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


GREEDY = SamplingParams(temperature=0, max_new_tokens=10)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_greedy_matches_transformers_generate(models, kind):
    hf, folder = models[kind]
    ps = prompts(4)
    outs = engine(folder).generate([Request(i, p, GREEDY) for i, p in enumerate(ps)])
    for p, out in zip(ps, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
            )
        assert out.tokens.response_ids == ref[0, len(p) :].tolist()
        assert out.finish_reason == ("stop" if out.tokens.response_ids[-1] == 2 else "length")


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 20)])
def test_logprobs_equal_full_forward(models, temperature, top_p, top_k):
    _, folder = models["qwen2"]
    eng = engine(folder)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12, seed=5)
    ps = prompts(3, seed=1)
    outs = eng.generate([Request(i, p, params) for i, p in enumerate(ps)])
    model = load_model(folder)
    for p, out in zip(ps, outs):
        ref32 = reference_logprobs(model, p, out.tokens.response_ids, temperature)
        ref64 = reference_logprobs(model, p, out.tokens.response_ids, temperature, torch.float64)
        got = torch.tensor(out.tokens.behaviour_logprobs, dtype=torch.float64)
        assert (got - ref32.double()).abs().max() <= 1e-4
        assert (got - ref64).abs().max() <= 1e-4
        assert out.tokens.versions == [0] * len(out.tokens.response_ids)


def test_truncated_sampling_stays_inside_the_kept_set(models):
    """top-k / top-p only restrict the draw: every token lies in the kept set of its step."""
    _, folder = models["llama"]
    model = load_model(folder)
    for params in (
        SamplingParams(top_k=3, max_new_tokens=6, seed=1),
        SamplingParams(top_p=0.5, max_new_tokens=6, seed=2),
    ):
        p = prompts(1, seed=3)[0]
        out = engine(folder).generate([Request("r", p, params)])[0]
        ids = torch.tensor(p + out.tokens.response_ids)
        cu = cu_seqlens_from_lengths([len(ids)])
        with torch.no_grad():
            probs = model.compute_logits(model(ids, packed_positions(cu), PackedAttention(cu)))[
                len(p) - 1 : -1
            ].softmax(-1)
        for step, tok in enumerate(out.tokens.response_ids):
            order = probs[step].argsort(descending=True).tolist()
            if params.top_k:
                assert tok in order[: params.top_k]
            else:
                rank = order.index(tok)
                assert probs[step][order[:rank]].sum() < params.top_p


@pytest.mark.parametrize("sampled", [False, True])
def test_abort_then_resume_equals_uninterrupted(models, sampled):
    _, folder = models["qwen3"]
    params = SamplingParams(temperature=0.8 if sampled else 0, max_new_tokens=14, ignore_eos=True, seed=11)
    ps = prompts(3, seed=4)
    full = engine(folder).generate([Request(i, p, params) for i, p in enumerate(ps)])

    eng = engine(folder)
    for i, p in enumerate(ps):
        eng.add(Request(i, p, params))
    for _ in range(6):
        eng.step()
    partial = eng.abort([0, 1, 2])
    assert all(0 < len(o.tokens.response_ids) < 14 and o.finish_reason == "abort" for o in partial)
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    resumed = eng.generate([Request(o.request_id, o.tokens, params) for o in partial])
    for a, b in zip(full, resumed):
        assert a.tokens.response_ids == b.tokens.response_ids
        assert torch.allclose(
            torch.tensor(a.tokens.behaviour_logprobs), torch.tensor(b.tokens.behaviour_logprobs), atol=1e-5
        )


def test_kv_blocks_return_and_preemption_keeps_outputs(models):
    """A cache too small for the batch forces preemption (recompute); outputs do not change."""
    _, folder = models["llama"]
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    ps = prompts(6, lo=8, hi=20, seed=5)
    big = engine(folder).generate([Request(i, p, params) for i, p in enumerate(ps)])
    small = engine(folder, max_kv_tokens=48, max_model_len=40)
    before = small.block_manager.num_free
    got = small.generate([Request(i, p, params) for i, p in enumerate(ps)])
    assert small.scheduler.num_preemptions > 0
    assert [o.tokens.response_ids for o in got] == [o.tokens.response_ids for o in big]
    assert small.block_manager.num_free == before == small.block_manager.num_blocks
    assert small.stats().kv_tokens == 0


def test_batch_invariance_seeded_request(models):
    _, folder = models["qwen2"]
    target = Request("t", prompts(1, seed=6)[0], SamplingParams(temperature=1.0, max_new_tokens=12, seed=1234))
    alone = engine(folder).generate([target])[0]
    others = [
        Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=int(4 + i % 9), seed=i))
        for i, p in enumerate(prompts(31, seed=7))
    ]
    eng = engine(folder, max_kv_tokens=4096, prefill_chunk_tokens=64)
    for r in others[:15]:
        eng.add(r)
    eng.step()  # the target joins a batch already in flight
    crowd = {o.request_id: o for o in eng.generate([Request("t", target.tokens, target.params)] + others[15:])}
    assert crowd["t"].tokens.response_ids == alone.tokens.response_ids


def greedy_tokens(model, prefix, n):
    ids = list(prefix)
    for _ in range(n):
        t = torch.tensor(ids)
        cu = cu_seqlens_from_lengths([len(t)])
        with torch.no_grad():
            ids.append(int(model.compute_logits(model(t, packed_positions(cu), PackedAttention(cu)))[-1].argmax()))
    return ids[len(prefix) :]


def test_stop_ids_and_length_limits(models):
    _, folder = models["qwen2"]
    eng = engine(folder, max_model_len=20)
    p = prompts(1, lo=10, hi=11, seed=12)[0]
    free_run = eng.generate([Request("a", p, SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True))])[0]
    assert free_run.finish_reason == "length" and len(p) + len(free_run.tokens.response_ids) == 19
    stop = free_run.tokens.response_ids[3]
    first = free_run.tokens.response_ids.index(stop)
    o = eng.generate(
        [Request("b", p, SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True, stop_ids=(stop,)))]
    )[0]
    assert o.finish_reason == "stop" and o.tokens.response_ids == free_run.tokens.response_ids[: first + 1]
    capped = eng.generate([Request("c", p, SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True))])[0]
    assert capped.finish_reason == "length" and len(p) + len(capped.tokens.response_ids) == 20


def test_bad_input_leaves_engine_unharmed(models):
    _, folder = models["llama"]
    eng = engine(folder, max_model_len=32)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    p = prompts(1, seed=13)[0]
    eng.add(Request("ok", p, params))
    eng.step()
    before = eng.stats()
    weights = {n: t.clone() for n, t in eng.model.state_dict().items()}
    with pytest.raises(EngineError, match="max_model_len=32"):
        eng.add(Request("long", list(range(3, 40)), params))
    with pytest.raises(EngineError, match="already in the engine"):
        eng.add(Request("ok", p, params))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        eng.add(Request("vocab", [5, 500], params))
    with pytest.raises(EngineError, match="unknown request_id 'nope'"):
        eng.abort(["ok", "nope"])
    assert eng.abort(["nope"], missing_ok=True) == []
    bad_name = dict(weights, **{"model.layers.0.mlp.gate.weight": torch.zeros(3)})
    with pytest.raises(EngineError, match="unknown parameter name 'model.layers.0.mlp.gate.weight'"):
        eng.load_weights(bad_name, version=1)
    bad_shape = {n: (torch.zeros(2, 2) if n.endswith("down_proj.weight") else t + 1) for n, t in weights.items()}
    with pytest.raises(EngineError, match="down_proj.weight' has shape"):
        eng.load_weights(bad_shape, version=1)
    missing = {n: t for n, t in weights.items() if "norm" not in n}
    with pytest.raises(EngineError, match="missing"):
        eng.load_weights(missing, version=1)
    with pytest.raises(EngineError, match="older"):
        eng.load_weights(weights, version=-1)
    after = eng.stats()
    assert (after.num_running, after.num_waiting, after.kv_tokens, after.version) == (
        before.num_running,
        before.num_waiting,
        before.kv_tokens,
        before.version,
    )
    assert all(torch.equal(t, weights[n]) for n, t in eng.model.state_dict().items())
    rest = []
    while eng.has_unfinished():
        rest += eng.step()
    fresh = engine(folder, max_model_len=32).generate([Request("ok", p, params)])[0]
    assert rest[0].tokens.response_ids == fresh.tokens.response_ids


def test_stats_track_running_waiting_and_kv(models):
    _, folder = models["qwen2"]
    eng = engine(folder, max_running=2)
    ps = prompts(3, lo=5, hi=6, seed=14)
    for i, p in enumerate(ps):
        eng.add(Request(i, p, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)))
    s0 = eng.stats()
    assert (s0.num_running, s0.num_waiting, s0.kv_tokens) == (0, 3, 0)
    eng.step()
    s1 = eng.stats()
    assert (s1.num_running, s1.num_waiting) == (2, 1)  # the 8-token budget: 5 prompt tokens + a 3-token chunk
    assert s1.running_ids == [0, 1] and s1.waiting_ids == [2]
    eng.step()
    s2 = eng.stats()
    assert s2.num_running == 2 and s2.kv_tokens == sum(s.num_computed for s in eng.scheduler.running)
    assert s2.kv_capacity == 1024 and s2.tokens_generated >= 1 and s2.last_step_latency_s > 0
    assert s2.throughput_tok_s > 0 and s2.steps == 2


def test_from_config_builds_from_the_run_config():
    from staleflow.config import ModelConfig, RolloutConfig

    eng = BuiltinEngine.from_config(
        ModelConfig(path="tiny-qwen2"),
        RolloutConfig(max_kv_tokens=512, block_size=8, max_model_len=64, profile=True),
        device="cpu",
        version=4,
    )
    out = eng.generate([Request("r", [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))])[0]
    assert out.tokens.versions == [4, 4, 4] and eng.stats().kv_capacity == 512 and eng.profile_samples
    assert eng.model.args.architecture == "qwen2"
    # a bf16 rollout engine next to an fp32 trainer: fp32 weights load into it (cast in place)
    bf = BuiltinEngine.from_config(
        ModelConfig(path="tiny-qwen2", dtype="float32"),
        RolloutConfig(max_kv_tokens=512, block_size=8, max_model_len=64, dtype="bfloat16"),
        device="cpu",
    )
    assert next(bf.model.parameters()).dtype == torch.bfloat16
    bf.load_weights({n: p.float() for n, p in eng.model.named_parameters()}, version=5)
    out = bf.generate([Request("r", [5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=3, seed=1))])[0]
    assert out.tokens.versions == [5, 5, 5] and all(lp <= 0 for lp in out.tokens.behaviour_logprobs)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decode_mirror_equals_paged_gather_under_churn(models, kind, tmp_path):
    """The dense decode mirror (CPU default) and the per-step paged gather give the same tokens
    and log-probs through continuous batching, preemption, aborts, resumes and a weight load;
    the mirror's rows are always exactly the decoding sequences."""
    _, folder = models[kind]
    make_hf(kind, seed=11).save_pretrained(tmp_path)
    new_state = dict(load_model(str(tmp_path)).state_dict())
    engines = [
        engine(folder, max_kv_tokens=160, max_model_len=80, max_running=6, decode_mirror=m) for m in (True, False)
    ]
    assert engines[0].runner.mirror is not None and engines[1].runner.mirror is None
    reqs = [
        Request(
            i,
            p,
            SamplingParams(
                temperature=1.0 if i % 2 else 0, max_new_tokens=int(6 + 3 * (i % 7)), ignore_eos=True, seed=i
            ),
        )
        for i, p in enumerate(prompts(14, lo=3, hi=30, seed=12))
    ]
    outs = [{}, {}]
    for e, out in zip(engines, outs):
        for r in reqs:
            e.add(r)
        step = 0
        while e.has_unfinished():
            for o in e.step():
                out[o.request_id] = o
            step += 1
            if step == 6:  # interrupt two running requests and resume them at the back
                for o in e.abort([s.request_id for s in e.scheduler.running[:2]]):
                    e.add(Request(o.request_id, o.tokens, reqs[o.request_id].params))
            if step == 12:
                e.load_weights(new_state, version=1)
            m = e.runner.mirror
            for r, s in enumerate(m.rows if m is not None else []):  # valid rows hold the paged K/V
                if s.kv_epoch == m.row_epoch[r] and s.status.value == "running":
                    n = m.row_len[r]
                    assert n == s.num_computed
                    slots = e.runner._slots(s.block_table, 0, n)
                    assert torch.equal(m.k[:, r, :, :n], e.runner.attn.k_cache[:, slots].transpose(1, 2))
                    assert torch.equal(m.v[:, r, :, :n], e.runner.attn.v_cache[:, slots].transpose(1, 2))
    assert engines[0].scheduler.num_preemptions > 0
    # the small cache also caps the mirror (rows x length <= 160 slots): some steps fell back to
    # the gather and later rebuilt the mirror, most used it
    assert 0 < engines[0].runner.mirror.fallbacks < engines[0].steps // 2
    assert outs[0].keys() == outs[1].keys() == set(range(14))
    for i in range(14):
        a, b = outs[0][i], outs[1][i]
        assert a.tokens.response_ids == b.tokens.response_ids and a.tokens.versions == b.tokens.versions
        assert max(abs(x - y) for x, y in zip(a.tokens.behaviour_logprobs, b.tokens.behaviour_logprobs)) <= 1e-5
