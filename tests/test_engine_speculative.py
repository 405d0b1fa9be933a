"""Speculative decoding from group siblings in the built-in engine (issue 49, item 3).

The drafts come from a suffix match over the group's tokens (rollout/drafts.py) and are verified in
one forward with exact rejection sampling (rollout/speculative.py). Checked here on tiny CausalLMs:
- greedy: the same tokens as plain decoding with every decode backend (mirror, gather, the Triton
  kernel through the interpreter, the flash-attn call through a stand-in), through preemption;
- sampled (temperature, top-k, top-p): the same tokens as plain decoding with the same seeds (the
  verification samples each position exactly as a plain decode would, so the coupling is exact);
- behaviour log-probs equal an independent fp64 full-sequence forward, versions the engine's;
- after every step the rejected drafts' K/V is gone: num_computed = len - 1, no block past the
  tokens, the paged cache and the mirror rows hold the K/V of the emitted tokens (fp64 reference);
- the sampled distribution is unchanged: a chi-square goodness of fit against the exact
  distribution of 4-token responses and a two-sample test against plain decoding (fixed seeds: a
  deterministic p value), with drafts forced at every step;
- abort + resume, a keep-KV weight load between verification steps, multi-turn hold / extend;
- the drafter itself, the flags, and the refusal with CUDA graphs.
"""

from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from test_engine_backends import _fake_flash_module, triton_here
from test_keep_kv import ARGS, Mixed, Recording, _models

from staleflow.config import RolloutConfig
from staleflow.config.speculative import SpeculativeConfig
from staleflow.faults import ConfigError
from staleflow.metrics.stats import chi2_two_sample
from staleflow.model import CausalLM, ModelArgs
from staleflow.rollout import BuiltinEngine, EngineError, Request, SamplingParams
from staleflow.rollout.drafts import SuffixDrafter
from staleflow.rollout.prefix_sharing import SharingBlockManager
from staleflow.tokens import TrajectoryTokens

SPEC = SpeculativeConfig(draft_tokens=4, max_batch=64)
GROUPS = {"a": [5, 17, 33, 8, 41, 9, 60, 12, 3], "b": [70, 71, 2, 9, 9, 30]}


def make_engine(spec: SpeculativeConfig | None = SPEC, std: float = 0.2, seed: int = 0, **kw) -> BuiltinEngine:
    model = CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=std, seed=seed)
    kw = {"max_kv_tokens": 1024, "block_size": 4, "prefill_chunk_tokens": 16, "max_model_len": 96, **kw}
    return BuiltinEngine(model, speculative=spec, **kw)


def group_requests(params) -> list[Request]:
    """Two GRPO groups of 5 and 3 members (params(member index) -> SamplingParams)."""
    return [Request(f"{g}{j}", p, params(j)) for g, p in GROUPS.items() for j in range(5 if g == "a" else 3)]


def run_staggered(eng: BuiltinEngine, reqs: list[Request], wave: int = 2, every: int = 6, check=None) -> dict:
    """Add `wave` requests every `every` steps, so later siblings decode with earlier ones' text ahead."""
    pending, outs, step = list(reqs), {}, 0
    while pending or eng.has_unfinished():
        if step % every == 0:
            for r in pending[:wave]:
                eng.add(r)
            del pending[:wave]
        for o in eng.step():
            outs[o.request_id] = o
        step += 1
        if check is not None:
            check(eng)
    return outs


def assert_same(a: dict, b: dict, logprob_tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        ta, tb = a[k].tokens, b[k].tokens
        assert ta.response_ids == tb.response_ids, k
        assert ta.versions == tb.versions and a[k].finish_reason == b[k].finish_reason
        assert max(abs(x - y) for x, y in zip(ta.behaviour_logprobs, tb.behaviour_logprobs)) <= logprob_tol


def ref_logprobs(model: CausalLM, tokens: list[int], temperature: float = 1.0, attn=None) -> torch.Tensor:
    """fp64 log_softmax(logits / T) of tokens[i + 1] given tokens[: i + 1], one full-sequence forward."""
    ids = torch.tensor(tokens)
    with torch.no_grad():
        hidden = model(ids, torch.arange(len(tokens)), attn or Recording())
        logits = F.linear(hidden.double(), model.lm_head_weight.double()) / temperature
    return torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]


def force_greedy_drafts(eng: BuiltinEngine, std: float) -> None:
    """Replace the group drafter by an oracle that drafts the model's greedy chain after each sequence's
    context: sampled rows then accept drafts as often as the model is peaked (a random model's samples
    rarely repeat their siblings' n-grams)."""
    model = CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=std, seed=0)

    memo: dict[tuple, int] = {}

    def propose(rid, k):
        ctx, out = tuple(eng.seqs[rid].token_slice(0, len(eng.seqs[rid]))), []
        for _ in range(k):
            if ctx not in memo:
                with torch.no_grad():
                    hidden = model(torch.tensor(ctx), torch.arange(len(ctx)), Recording())
                memo[ctx] = int(model.compute_logits(hidden[-1:]).argmax())
            out.append(memo[ctx])
            ctx = ctx + (out[-1],)
        return out

    eng.speculator.drafter.propose = propose


def greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models, many small ops: one thread is several times faster on a shared 2-core VM."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- exactness --------------------------------------------------------------------------------


def test_speculative_steps_that_feed_drafts_are_not_cost_samples():
    """The decode cost model (CostSample) is of steps that feed one token a sequence: a verification step feeds
    1 + its draft rows per sequence, so profiling leaves it out (it would read as a slow one-token step)."""
    counts = {}
    for name, spec in (("plain", None), ("spec", SPEC)):
        eng = make_engine(spec, std=2.0, profile=True)
        if spec is not None:
            force_greedy_drafts(eng, 2.0)
        run_staggered(eng, group_requests(lambda j: greedy(24)))
        counts[name] = (len(eng.profile_samples), eng.steps)
        if spec is not None:
            assert eng.speculator.stats.drafted > 0
    assert counts["plain"][0] == counts["plain"][1]
    assert 0 < counts["spec"][0] < counts["spec"][1]


@pytest.mark.parametrize("backend", ["mirror", "gather"])
def test_speculative_greedy_equals_plain_decoding(backend):
    kw = dict(decode_backend=backend, max_kv_tokens=96, max_running=6)  # 24 blocks: preemptions happen
    reqs = group_requests(lambda j: greedy(24 + 4 * j))
    plain = run_staggered(make_engine(None, **kw), reqs)
    eng = make_engine(**kw)
    spec = run_staggered(eng, reqs)
    assert_same(spec, plain)
    st = eng.speculator.stats
    assert st.accepted > 20 and st.drafted > st.accepted, st.as_dict()  # drafts were accepted and rejected
    assert st.accepted_per_forward > 1.2
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


@triton_here
def test_speculative_triton_kernel_verifies_like_gather():
    """The Triton paged kernel (interpreter) reads one row per fed token: sampled tokens with forced
    drafts, accepted and rejected, equal plain decoding on the gather path with the same seeds."""
    kw = dict(max_kv_tokens=64, max_model_len=64, std=0.6)
    reqs = [Request(j, GROUPS["a"], SamplingParams(max_new_tokens=12, ignore_eos=True, seed=j)) for j in range(3)]
    eng = make_engine(decode_backend="triton", **kw)
    force_greedy_drafts(eng, 0.6)
    assert eng.runner.backend == "triton"
    assert_same(run_staggered(eng, reqs), run_staggered(make_engine(None, decode_backend="gather", **kw), reqs), 1e-4)
    st = eng.speculator.stats
    assert st.accepted > 0 and st.drafted > st.accepted, st.as_dict()


@triton_here
def test_speculative_flash_call_reads_one_row_per_fed_token(monkeypatch):
    """flash-attn (a stand-in following its documented signature): one query per row, so a verification
    step repeats a sequence's block table for each fed token with its own cache_seqlens."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(calls))
    kw = dict(block_size=256, max_kv_tokens=2048, max_model_len=96, decode_backend="triton")
    eng = make_engine(**kw)
    eng.runner.backend = eng.runner.attn.backend = "flash"  # CPU: the resolver would refuse flash
    reqs = group_requests(lambda j: greedy(20))
    spec = run_staggered(eng, reqs)
    assert_same(spec, run_staggered(make_engine(None, **{**kw, "decode_backend": "gather"}), reqs))
    assert eng.speculator.stats.accepted > 0 and max(calls) > 8  # rows = fed tokens, more than sequences


def test_speculative_sampling_with_the_same_seeds_emits_the_plain_tokens():
    """Verification samples position i from the target exactly as a plain decode does (same uniform),
    so a seeded request emits the same tokens with and without speculation, truncation included."""

    def params(j):
        return SamplingParams(
            temperature=(0.7, 1.0, 1.3)[j % 3], top_k=(0, 20, 0)[j % 3], top_p=(1.0, 1.0, 0.9)[j % 3],
            max_new_tokens=30, ignore_eos=True, seed=1000 + j,
        )  # fmt: skip

    reqs = group_requests(params)
    eng = make_engine(std=0.6)
    force_greedy_drafts(eng, 0.6)
    spec = run_staggered(eng, reqs)
    assert_same(spec, run_staggered(make_engine(None, std=0.6), reqs), logprob_tol=1e-4)  # peaked: larger logits
    assert eng.speculator.stats.accepted > 10, eng.speculator.stats.as_dict()


def test_speculative_logprobs_equal_a_plain_forward():
    eng = make_engine(std=0.6)
    force_greedy_drafts(eng, 0.6)
    reqs = group_requests(lambda j: SamplingParams(temperature=0.8, max_new_tokens=30, seed=j))  # eos may stop
    outs = run_staggered(eng, reqs)
    assert eng.speculator.stats.accepted > 10
    model = CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.6, seed=0)
    for o in outs.values():
        p = o.tokens.prompt_ids
        want = ref_logprobs(model, p + o.tokens.response_ids, 0.8)[len(p) - 1 :]
        got = torch.tensor(o.tokens.behaviour_logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # fp32 engine, peaked model: |logit| up to ~10
        assert o.tokens.versions == [0] * len(got)
        assert o.finish_reason == "length" or o.tokens.response_ids[-1] == 1  # eos ends, never in a draft's middle


@pytest.mark.parametrize("backend,sharing", [("mirror", True), ("gather", False)])
def test_speculative_rolls_back_the_rejected_drafts_kv(backend, sharing):
    """After every step: a decoding sequence has num_computed = len - 1, no block past its tokens, and
    the cache (paged, and the mirror row) holds the K/V of exactly its tokens, not of a rejected draft."""
    eng = make_engine(decode_backend=backend, prefix_sharing=sharing, std=0.6)
    force_greedy_drafts(eng, 0.6)  # sampled tokens: drafts both accepted and rejected
    model = CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.6, seed=0)
    bs = eng.block_manager.block_size
    checked = {"rows": 0, "rejected_steps": 0}

    def check(e: BuiltinEngine):
        st = e.speculator.stats
        if st.drafted - st.accepted > checked.get("rejected", 0):
            checked["rejected_steps"] += 1
        checked["rejected"] = st.drafted - st.accepted
        if isinstance(e.block_manager, SharingBlockManager):
            e.block_manager.check(e.seqs.values())
        for seq in e.scheduler.running:
            assert not seq.draft
            if seq.in_prefill:
                continue
            assert seq.num_computed == len(seq) - 1
            assert math.ceil(seq.num_computed / bs) <= len(seq.block_table) <= math.ceil(len(seq) / bs)
            rec = Recording()
            ref_logprobs(model, seq.token_slice(0, len(seq)), attn=rec)
            slots = torch.tensor([e.block_manager.slot(seq, p) for p in range(seq.num_computed)])
            for layer, (k, v) in rec.kv.items():
                tol = dict(atol=1e-4, rtol=1e-4)  # a rejected draft's K/V would be off by O(1)
                torch.testing.assert_close(e.runner.attn.k_cache[layer, slots], k[: seq.num_computed], **tol)
                torch.testing.assert_close(e.runner.attn.v_cache[layer, slots], v[: seq.num_computed], **tol)
            checked["rows"] += 1
        mirror = e.runner.mirror
        if mirror is not None:
            for r, seq in enumerate(mirror.rows):
                if seq.status.value == "running" and not seq.in_prefill:
                    assert mirror.row_len[r] == seq.num_computed

    run_staggered(
        eng, group_requests(lambda j: SamplingParams(max_new_tokens=24, ignore_eos=True, seed=j)), check=check
    )
    assert checked["rows"] > 50 and checked["rejected_steps"] > 10 and eng.speculator.stats.accepted > 10
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


# ---- the sampled distribution ----------------------------------------------------------------

DIST_ARGS = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
DIST_PROMPT = [1, 2, 3, 4, 5, 6, 7]
DIST_T, DIST_NEW, DIST_N = 1.5, 4, 3000


def _dist_model() -> CausalLM:
    return CausalLM(ModelArgs(**DIST_ARGS, eos_token_ids=[0])).init_weights(std=0.2, seed=0)


class ExactTarget:
    """p(. | context) at temperature DIST_T from fp64 full forwards of the same model, memoised."""

    def __init__(self):
        self.model, self.cache = _dist_model().double(), {}

    def __call__(self, ctx) -> torch.Tensor:
        ctx = tuple(ctx)
        if ctx not in self.cache:
            ids = torch.tensor(ctx)
            with torch.no_grad():
                hidden = self.model(ids, torch.arange(len(ctx)), Recording())
                self.cache[ctx] = torch.softmax(self.model.compute_logits(hidden)[-1].double() / DIST_T, -1)
        return self.cache[ctx]

    def chain(self, ctx, k: int) -> list[int]:
        """The k most likely tokens one after another: a draft that is often right, often wrong."""
        out, ctx = [], list(ctx)
        for _ in range(k):
            out.append(int(self(ctx).argmax()))
            ctx.append(out[-1])
        return out


def sample_responses(speculative: bool, seeds, target: ExactTarget) -> tuple[list[tuple], BuiltinEngine]:
    eng = BuiltinEngine(
        _dist_model(), max_running=256, max_kv_tokens=8192, block_size=4, prefill_chunk_tokens=4096,
        max_model_len=32, speculative=SpeculativeConfig(draft_tokens=3, max_batch=256, adaptive=False)
        if speculative else None,
    )  # fmt: skip
    if speculative:  # a draft at every decode: the greedy chain after the sequence's context
        eng.speculator.drafter.propose = lambda rid, k: target.chain(DIST_PROMPT + eng.seqs[rid].tokens.response_ids, k)
    params = [SamplingParams(temperature=DIST_T, max_new_tokens=DIST_NEW, ignore_eos=True, seed=s) for s in seeds]
    outs = eng.generate([Request(i, DIST_PROMPT, p) for i, p in enumerate(params)])
    return [tuple(o.tokens.response_ids) for o in outs], eng


def goodness_of_fit(samples: list[tuple], target: ExactTarget, min_expected: float = 5.0) -> float:
    """Chi-square p value of the responses against their exact distribution (rare outcomes pooled)."""
    from collections import Counter

    from scipy.stats import chisquare

    counts, n = Counter(samples), len(samples)
    obs, exp, rare_o, rare_e = [], [], 0, 0.0
    for resp in itertools.product(range(DIST_ARGS["vocab_size"]), repeat=DIST_NEW):
        p, ctx = 1.0, list(DIST_PROMPT)
        for t in resp:
            p *= float(target(ctx)[t])
            ctx.append(t)
        if p * n >= min_expected:
            obs.append(counts[resp])
            exp.append(p * n)
        else:
            rare_o, rare_e = rare_o + counts[resp], rare_e + p * n
    obs.append(rare_o)
    exp.append(rare_e)
    return float(chisquare(obs, exp).pvalue)


def test_speculative_sampled_distribution_is_unchanged():
    """4-token responses at a high-entropy temperature (1.5, vocabulary 8), a draft forced at every
    decode (the greedy chain: accepted ~1 time in 5). The same draws with an accept-every-draft rule,
    an off-by-one that emits the token after a rejection (sampled after the rejected draft), or a
    rule that always keeps the first draft token give p < 1e-6 in both tests (checked by breaking
    Speculator.accept on purpose, 2026-12-07); the correct rule gives p 0.2-0.3 here."""
    target = ExactTarget()
    spec, eng = sample_responses(True, range(DIST_N), target)
    plain, _ = sample_responses(False, range(DIST_N, 2 * DIST_N), target)
    st = eng.speculator.stats
    assert st.drafted > 5000 and 0.1 < st.accepted / st.drafted < 0.4, st.as_dict()
    two = chi2_two_sample(spec, plain)
    assert two["cells"] > 50
    gof = goodness_of_fit(spec, target)
    assert gof > 1e-3 and two["p"] > 1e-3, (gof, two)
    assert goodness_of_fit(plain, target) > 1e-3


# ---- interruption, weight loads, turns ----------------------------------------------------------


def test_speculative_abort_and_resume_continue_the_same_tokens():
    reqs = group_requests(lambda j: SamplingParams(temperature=1.0 if j % 2 else 0, max_new_tokens=30, seed=j))
    reqs = [Request(r.request_id, r.tokens, r.params) for r in reqs]
    whole = run_staggered(make_engine(None, std=0.6), reqs)
    eng = make_engine(std=0.6)
    force_greedy_drafts(eng, 0.6)
    for r in reqs:
        eng.add(r)
    outs = {}
    for _ in range(8):
        for o in eng.step():
            outs[o.request_id] = o
    assert eng.speculator.stats.accepted > 0
    parts = eng.abort([s.request_id for s in eng.scheduler.running[:3]])
    assert all(p.tokens.response_ids for p in parts)
    for p in parts:  # resumed on another engine, and on this one
        eng.add(p)
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert_same(outs, whole, logprob_tol=1e-4)
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_speculative_keep_kv_pull_between_verification_steps():
    """A keep_kv load while sequences speculate: tokens before it keep version 0 and the old model's
    log-probs, tokens after carry version 1 and the log-probs of the new weights over the old K/V."""
    old, new = _models()
    eng = make_engine(std=0.2)
    force_greedy_drafts(eng, 0.2)  # the old weights' greedy chain: all accepted before the load, not after
    prompt = GROUPS["a"]
    for j in range(3):
        eng.add(Request(j, prompt, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)))
    while min(s.num_output for s in eng.seqs.values()) < 8:
        assert eng.step() == []
    assert eng.speculator.stats.accepted > 0 and max(s.num_output for s in eng.seqs.values()) < 20
    cut = {rid: s.num_computed for rid, s in eng.seqs.items()}
    n_old = {rid: s.num_output for rid, s in eng.seqs.items()}
    eng.load_weights(dict(new.named_parameters()), version=1, keep_kv=True)
    drafted = eng.speculator.stats.drafted
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert eng.speculator.stats.drafted > drafted  # drafts were verified under the new weights too
    for rid, o in outs.items():
        k, tokens = n_old[rid], prompt + o.tokens.response_ids
        assert o.tokens.versions == [0] * k + [1] * (30 - k)
        rec = Recording()
        want_old = ref_logprobs(old, tokens, attn=rec)[len(prompt) - 1 :]
        want_mixed = ref_logprobs(new, tokens, attn=Mixed(rec.kv, cut[rid]))[len(prompt) - 1 :]
        got = torch.tensor(o.tokens.behaviour_logprobs, dtype=torch.float64)
        torch.testing.assert_close(got[:k], want_old[:k], atol=2e-5, rtol=0)
        torch.testing.assert_close(got[k:], want_mixed[k:], atol=2e-5, rtol=0)


def test_speculative_multi_turn_hold_and_extend_equal_plain():
    obs = [70, 71, 72, 73, 74]

    def turns(eng):
        for j in range(3):
            eng.add(Request(f"t{j}", GROUPS["a"], greedy(12), hold=True))
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
        for j in range(3):
            eng.extend(f"t{j}", obs, 14)
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
        for j in range(3):
            eng.release(f"t{j}")
        assert eng.block_manager.num_free == eng.block_manager.num_blocks
        return outs

    eng = make_engine()
    assert_same(turns(eng), turns(make_engine(None)))
    assert eng.speculator.stats.accepted > 0 and not eng.speculator.drafter.members


# ---- the drafter, flags, refusals -----------------------------------------------------------


def test_speculative_drafter_matches_siblings_own_context_and_the_longest_suffix():
    d = SuffixDrafter(min_match=2, max_match=4)
    a = TrajectoryTokens([1, 2, 3])
    a.response_ids.extend([4, 5, 6, 7, 8, 9])
    d.join("a", a)
    b = TrajectoryTokens([1, 2, 3])
    d.join("b", b)
    d.leave("a")  # a finished: its text still drafts for its siblings while the group lives
    assert d.propose("b", 3) == [4, 5, 6]  # the prompt's suffix [2, 3] continues in a's response
    b.response_ids.extend([4, 5, 6, 7])
    assert d.propose("b", 10) == [8, 9]  # a's text ends there
    b.response_ids.extend([50, 5, 6])
    assert d.propose("b", 2) == [7, 50]  # [5, 6] was followed by 7: the latest occurrence is b's own
    assert d.propose("b", 0) == [] and d.propose("nobody", 2) == []
    c = TrajectoryTokens([9, 9])  # another prompt: another group
    d.join("c", c)
    assert d.propose("c", 4) == []
    d.leave("b")
    assert list(d.groups) == [(9, 9)] and d.propose("b", 2) == []
    own = SuffixDrafter(min_match=2, max_match=4, siblings=False)
    own.join("a", a)
    own.join("b", TrajectoryTokens([1, 2, 3]))
    assert own.propose("b", 3) == []  # without siblings only b's own context is searched


def test_speculative_flags_default_off_parse_and_validate():
    assert not RolloutConfig().speculative.enabled and make_engine(RolloutConfig().speculative).speculator is None
    from staleflow.config import RunConfig
    from staleflow.config.file import apply_dict
    from staleflow.config.parse import parse
    from staleflow.presets import PRESETS

    cfg = parse(RunConfig, ["--rollout.speculative.draft-tokens", "3"], PRESETS, default="tiny", prog="t")
    assert cfg.rollout.speculative == SpeculativeConfig(draft_tokens=3)
    cfg = apply_dict(cfg, {"rollout": {"speculative": {"max-batch": 2}}}, "run.yaml")
    assert cfg.rollout.speculative.max_batch == 2 and cfg.rollout.speculative.draft_tokens == 3
    for bad, flag in ((dict(draft_tokens=-1), "draft-tokens"), (dict(min_match=3, max_match=2), "max-match")):
        with pytest.raises(ConfigError, match=f"--rollout.speculative.{flag}="):
            SpeculativeConfig(**bad)
    with pytest.raises(ConfigError, match="--rollout.speculative.draft-tokens=2 .*built-in engine's") as e:
        RolloutConfig(engine="vllm", speculative=SpeculativeConfig(draft_tokens=2))
    assert "\n" not in str(e.value)


def test_speculative_is_refused_with_cuda_graphs_in_one_line():
    with pytest.raises(EngineError, match="refused with --rollout.cuda-graphs") as e:
        make_engine(cuda_graphs=True)
    assert "\n" not in str(e.value)


@pytest.mark.scripts_smoke  # the smoke row of bench_speculative.py in tests/test_scripts_smoke.py
def test_speculative_bench_quick_reports_drafts_against_the_baseline():
    """scripts/bench_speculative.py --quick (tiny-llama): one JSON line with the same run's baseline; the
    greedy long workload drafts from its group and emits the plain engine's tokens."""
    from test_scripts_smoke import run_script

    out, _ = run_script("bench_speculative.py", ["--quick"], timeout=300)
    for key in ("accepted_per_forward", "decode_speedup", "same_distribution", "hardware"):
        assert key in out, key
    long = out["long"]
    assert long["accepted_per_forward"] > 1.2 and long["same_tokens"] == "4/4", long
    assert long["wall_s"] > 0 and long["wall_s_baseline"] > 0 and 0 <= out["same_distribution"] <= 1
