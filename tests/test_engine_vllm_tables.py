"""VllmEngine's request bookkeeping without vLLM: the engine keeps its own Requests and side tables by
request id (vLLM id, prefix-cache hits), no per-request record of its own.

vLLM is not needed here: a scripted stand-in for its LLMEngine (add_request / step / abort_request /
reset_prefix_cache / collective_rpc, DELTA outputs, one token per request per step, each token a
function of the whole history so a resubmitted request continues as if uninterrupted) drives the
engine's add / step / abort / extend / release / weight-load paths. tests/test_vllm_engine.py checks
the same engine against the real vLLM (CPU build) where it is installed.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from staleflow.rollout.engine import EngineError, Request, SamplingParams
from staleflow.rollout.vllm_engine import VllmEngine

VOCAB, STOP = 64, 3


def next_token(history: list[int]) -> int:
    return (sum(history) * 7 + len(history)) % (VOCAB - 4) + 4  # never STOP: requests end by length


class ScriptedLLM:
    """vLLM's LLMEngine as VllmEngine drives it (token-id prompts, DELTA outputs, logprobs=0)."""

    def __init__(self):
        self.reqs: dict[str, list] = {}  # vid -> [history, SamplingParams, generated]
        self.prompts: dict[str, list[int]] = {}
        self.seeds: dict[str, int] = {}
        self.aborted: list[str] = []
        self.late: list[str] = []  # aborted vids whose last output still arrives (multiprocess mode)

    def add_request(self, vid, prompt, vp):
        assert vid not in self.reqs and vid not in self.prompts, f"vLLM id {vid} reused"
        self.reqs[vid] = [list(prompt["prompt_token_ids"]), vp, 0]
        self.prompts[vid] = list(prompt["prompt_token_ids"])
        self.seeds[vid] = vp.seed

    def abort_request(self, vids):
        for v in vids:
            del self.reqs[v]
        self.aborted += vids

    def step(self):
        outs = [self._out(v, [5], "abort", True) for v in self.late]
        self.late = []
        for vid, r in list(self.reqs.items()):
            history, vp, n = r
            tok = next_token(history)
            history.append(tok)
            r[2] = n = n + 1
            done = n >= vp.max_tokens or tok in vp.stop_token_ids
            if done:
                del self.reqs[vid]
            outs.append(self._out(vid, [tok], "length" if done else None, done))
        return outs

    @staticmethod
    def _out(vid, ids, reason, finished):
        lps = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
        c = SimpleNamespace(token_ids=ids, logprobs=lps, finish_reason=reason)
        return SimpleNamespace(request_id=vid, outputs=[c], finished=finished, num_cached_tokens=16)

    def reset_prefix_cache(self):
        return not self.reqs

    def collective_rpc(self, name, args=()):
        assert name == "staleflow_pull_weights"
        return [7]


@pytest.fixture
def engine(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = SimpleNamespace(DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    eng = object.__new__(VllmEngine)  # __init__ starts vLLM: set what it would, then its request tables
    eng.llm, eng.vocab_size, eng.eos_ids, eng.max_model_len = ScriptedLLM(), VOCAB, frozenset({STOP}), 64
    eng.version, eng.temperature, eng.logprobs_mode = 0, 1.0, "raw_logprobs"
    eng.block_size, eng.kv_capacity, eng._sched = 16, 1024, {}
    eng._init_requests(seed=0)
    return eng


def run(eng, rid):
    for _ in range(100):
        for out in eng.step():
            if out.request_id == rid:
                return out
    raise AssertionError(f"{rid!r} did not stop")


def tables_empty(eng) -> bool:
    return eng.requests.empty


def expected(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(next_token(history))
    return history[len(prompt) :]


def test_vllm_tables_hold_the_engines_own_requests_and_return_copies(engine):
    prompt = [5, 9, 11, 2]
    caller = Request("a", prompt, SamplingParams(max_new_tokens=6))
    engine.add(caller)
    assert engine.requests.live["a"] is not caller and isinstance(engine.requests.live["a"].seed, int)
    assert engine.requests.vid == {"a": "0"} and engine.requests.by_vid == {"0": "a"}
    out = run(engine, "a")
    assert out.tokens.response_ids == expected(prompt, 6) and out.tokens.versions == [0] * 6
    assert out.finish_reason == "length" and out.seed == engine.llm.seeds["0"]  # drawn at add, sent to vLLM
    assert caller.tokens.response_ids == [] and caller.seed is None and caller.finish_reason is None
    assert tables_empty(engine) and not engine.has_unfinished()
    engine.add(Request("b", prompt, SamplingParams(max_new_tokens=2), seed=11))
    with pytest.raises(EngineError, match="already in the engine"):
        engine.add(Request("b", prompt))
    assert run(engine, "b").seed == 11 == engine.llm.seeds["1"]


def test_vllm_tables_turns_extend_resubmit_the_history_and_release_forgets(engine):
    prompt = [5, 9, 11, 2]
    engine.add(Request("t", prompt, SamplingParams(max_new_tokens=3), hold=True))
    first = run(engine, "t")
    own = engine.requests.parked["t"]
    assert first is not own and first.tokens.response_ids is not own.tokens.response_ids
    assert engine.requests.cached_tokens == {"t": 16} and not engine.requests.vid and not engine.requests.by_vid
    assert engine.stats().parked_ids == ["t"] and not engine.has_unfinished()
    kept = first.tokens.copy()
    engine.extend("t", [40, 41], 4)
    assert engine.llm.prompts["1"] == prompt + first.tokens.response_ids + [40, 41]  # the whole history resubmitted
    second = run(engine, "t")
    assert first.tokens == kept and first.finish_reason == "length"
    assert second.tokens.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1, 1] and second.seed == first.seed
    with pytest.raises(EngineError, match="unknown here"):
        engine.release("nope")
    engine.release("t")
    assert tables_empty(engine)
    engine.add(Request("u", prompt, SamplingParams(max_new_tokens=2), hold=True))
    parked = run(engine, "u")
    (aborted,) = engine.abort(["u"])  # a parked request: nothing to abort inside vLLM
    assert aborted.finish_reason == "abort" and aborted.tokens == parked.tokens and engine.llm.aborted == []
    assert tables_empty(engine)


def test_vllm_tables_abort_and_weight_load_keep_tokens_and_drop_stale_vllm_ids(engine):
    prompt = [7, 1, 8]
    engine.add(Request("r", prompt, SamplingParams(max_new_tokens=8)))
    engine.add(Request("s", prompt, SamplingParams(max_new_tokens=8)))
    engine.step()
    engine.step()
    (part,) = engine.abort(["s"])
    assert part.finish_reason == "abort" and part.tokens.response_ids == expected(prompt, 2)
    assert (
        engine.llm.aborted == ["1"]
        and "s" not in engine.requests.cached_tokens
        and engine.requests.by_vid == {"0": "r"}
    )
    engine.llm.late = ["1"]  # its last output arrives after the abort: ignored
    engine.step()
    assert engine.load_from_server("run", reader=0) == 7 and engine.version == 7
    assert (
        engine.llm.aborted == ["1", "0"] and engine.requests.vid == {"r": "2"} and engine.requests.by_vid == {"2": "r"}
    )
    assert engine.llm.prompts["2"] == prompt + expected(prompt, 3)  # resubmitted with its tokens
    done = run(engine, "r")
    assert done.tokens.response_ids == expected(prompt, 8) and done.tokens.versions == [0] * 3 + [7] * 5
    (resumed,) = engine.generate([part])  # the partial request comes back as it was returned
    assert resumed.tokens.response_ids == expected(prompt, 8) and resumed.seed == part.seed
    assert resumed.tokens.versions == [0, 0] + [7] * 6 and tables_empty(engine)
