"""Built-in engine weights: loading new weights (fresh, mid-flight), resuming a trajectory on
another instance, and the rollout dtype the weights are loaded and run in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import GREEDY, engine, greedy_tokens, make_hf, models, prompts, reference_logprobs  # noqa: E402,F401  (models: fixture)

from staleflow.model import load_model  # noqa: E402
from staleflow.rollout import Request, SamplingParams  # noqa: E402

transformers = pytest.importorskip("transformers")


def test_load_weights_matches_fresh_engine(models, tmp_path):
    _, folder = models["qwen3"]
    new = make_hf("qwen3", seed=9)
    new.save_pretrained(tmp_path)
    ps = prompts(3, seed=8)
    params = SamplingParams(temperature=0.9, max_new_tokens=8, seed=3)
    eng = engine(folder)
    eng.generate([Request(i, p, params) for i, p in enumerate(ps)])
    state = load_model(str(tmp_path)).state_dict()
    eng.load_weights(state.items(), version=3)  # an iterable of (name, tensor) pairs
    got = eng.generate([Request(i, p, params) for i, p in enumerate(ps)])
    want = engine(str(tmp_path)).generate([Request(i, p, params) for i, p in enumerate(ps)])
    assert [o.tokens.response_ids for o in got] == [o.tokens.response_ids for o in want]
    assert all(o.tokens.versions == [3] * len(o.tokens.response_ids) for o in got)
    assert eng.stats().version == 3


def test_load_weights_mid_flight_restamps_and_recomputes(models, tmp_path):
    """Tokens after a load carry the new version and are exact under the new weights."""
    _, folder = models["llama"]
    make_hf("llama", seed=10).save_pretrained(tmp_path)
    new_model = load_model(str(tmp_path))
    eng = engine(folder)
    p = prompts(1, seed=9)[0]
    eng.add(Request("r", p, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)))
    for _ in range(5):
        eng.step()
    n_old = eng.seqs["r"].num_output
    eng.load_weights(dict(new_model.state_dict()), version=1)
    out = []
    while eng.has_unfinished():
        out += eng.step()
    (o,) = out
    assert o.tokens.versions == [0] * n_old + [1] * (10 - n_old)
    ref = reference_logprobs(new_model, p + o.tokens.response_ids[:n_old], o.tokens.response_ids[n_old:])
    assert (torch.tensor(o.tokens.behaviour_logprobs[n_old:]) - ref).abs().max() <= 1e-4
    assert o.tokens.response_ids[n_old:] == [
        int(x) for x in greedy_tokens(new_model, p + o.tokens.response_ids[:n_old], 10 - n_old)
    ]


def test_resume_on_another_instance_mixes_versions(models):
    """Interrupted on a version-0 instance, resumed on a version-2 one: per-token versions show both."""
    _, folder = models["qwen2"]
    params = SamplingParams(temperature=0.9, max_new_tokens=10, ignore_eos=True, seed=21)
    p = prompts(1, seed=15)[0]
    a = engine(folder)
    a.add(Request("m", p, params))
    for _ in range(5):
        a.step()
    (part,) = a.abort(["m"])
    b = engine(folder, version=2)
    (out,) = b.generate([Request("m", part.tokens, params)])
    k = len(part.tokens.response_ids)
    assert (
        out.tokens.response_ids[:k] == part.tokens.response_ids
        and out.tokens.behaviour_logprobs[:k] == part.tokens.behaviour_logprobs
    )
    assert out.tokens.versions == [0] * k + [2] * (10 - k)
    full = engine(folder).generate([Request("m", p, params)])[0]
    assert out.tokens.response_ids == full.tokens.response_ids  # same weights: the seeded stream continues exactly


def test_rollout_rank_engine_runs_in_the_rollout_dtype():
    """build_engine (what a rollout rank runs) honours --rollout.dtype, and auto follows
    --model.dtype, from an fp32 model as well as from one the rank loaded in that dtype."""
    from types import SimpleNamespace

    from staleflow.config import ModelConfig, RolloutConfig, RunConfig
    from staleflow.workers.rollout import build_engine

    def dtype_of(**rollout):
        cfg = RunConfig(
            model=ModelConfig(path="tiny-qwen2"),
            rollout=RolloutConfig(max_kv_tokens=512, block_size=8, max_model_len=64, **rollout),
        )
        eng = build_engine(SimpleNamespace(cfg=cfg, rank=1), load_model("tiny-qwen2"))
        out = eng.generate([Request("r", [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))])
        assert len(out[0].tokens.response_ids) == 2
        return next(eng.model.parameters()).dtype

    assert dtype_of(dtype="bfloat16") == torch.bfloat16
    assert dtype_of() == torch.float32  # auto -> model auto -> float32 on CPU


def test_load_rollout_model_casts_each_tensor_to_the_rollout_dtype_as_it_loads():
    """What a built-in rollout rank loads (launch/entry.py): the same values as the fp32 model cast
    afterwards, without the fp32 copy."""
    from staleflow.config import ModelConfig, RolloutConfig
    from staleflow.rollout.builtin_engine import load_rollout_model

    m = load_rollout_model(ModelConfig(path="tiny-qwen2"), RolloutConfig(dtype="bfloat16"), "cpu")
    ref = load_model("tiny-qwen2").to(torch.bfloat16).state_dict()
    got = m.state_dict()
    assert got.keys() == ref.keys() and all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k]) for k in ref)
    assert (
        next(load_rollout_model(ModelConfig(path="tiny-qwen2"), RolloutConfig(), "cpu").parameters()).dtype
        == torch.float32
    )  # auto on CPU
