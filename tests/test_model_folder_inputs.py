"""Crafted model folders (model/args.py, model/hf.py, model/tokenizer.py): config.json decoded into
typed, range-checked values and checked against the safetensors headers before any model is built;
custom code (auto_map) refused; trust_remote_code never left to transformers' prompt."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.model import hf
from staleflow.model.hf import ModelLoadError, check_tokenizer_config, lazy_folder, read_model_args
from staleflow.model.loader import resolve_model_path
from staleflow.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return Path(resolve_model_path("tiny-llama"))


def _copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".staleflow-*"))
    if config:
        d = json.loads((dst / "config.json").read_text())
        d.update(config)
        (dst / "config.json").write_text(json.dumps(d))
    return dst


@pytest.fixture
def built_layers(monkeypatch):
    """The num_layers of every CausalLM the loader builds."""
    seen = []
    real = hf.CausalLM

    def record(args):
        seen.append(args.num_layers)
        return real(args)

    monkeypatch.setattr(hf, "CausalLM", record)
    return seen


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_hidden_layers": 1000000}, "num_hidden_layers"),
        ({"num_hidden_layers": 30}, "num_hidden_layers is 30, the safetensors hold 2 layers"),
        ({"vocab_size": 1e12}, "vocab_size"),
        ({"vocab_size": 10**12}, "vocab_size"),
        ({"vocab_size": 98304}, "vocab_size x hidden_size"),
        ({"intermediate_size": 256}, "mlp"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 1e300}}, "rope_parameters.factor"),
        ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.factor is missing"),
        ({"rope_theta": float("inf"), "rope_parameters": None}, "rope_theta"),
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"num_attention_heads": "4"}, "num_attention_heads"),
        ({"eos_token_id": 10**9}, "eos_token_id"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"architectures": "LlamaForCausalLM"}, "architectures"),
    ],
)
def test_crafted_config_is_refused_in_one_line_before_any_model_is_built(
    tmp_path, tiny_folder, built_layers, change, field
):
    folder = _copy(tiny_folder, tmp_path / "m", **change)
    with pytest.raises(ModelLoadError) as info:
        lazy_folder(folder)
    msg = str(info.value)
    assert field in msg and "config.json" in msg and "\n" not in msg, msg
    assert all(n == 1 for n in built_layers), built_layers  # at most expected_shapes' one-layer meta model


def test_remote_code_auto_map_in_config_is_refused(tmp_path, tiny_folder):
    folder = _copy(tiny_folder, tmp_path / "m", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(ModelLoadError, match="auto_map"):
        read_model_args(folder)


def test_remote_code_tokenizer_is_never_run(tmp_path, tiny_folder):
    folder = _copy(tiny_folder, tmp_path / "m")
    canary = tmp_path / "canary"
    (folder / "tokenization_evil.py").write_text(
        f"open({str(canary)!r}, 'w').write('ran')\nfrom transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    for load in (load_tokenizer, lazy_folder):
        with pytest.raises(ModelLoadError, match="auto_map") as info:
            load(str(folder))
        assert "tokenizer_config.json" in str(info.value)
    assert not canary.exists()
    from transformers import AutoTokenizer  # what the loader passes: transformers then ignores auto_map, never asks

    AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    assert not canary.exists()


def test_crafted_config_refused_by_staleflow_check_in_one_line(tmp_path, tiny_folder):
    folder = _copy(tiny_folder, tmp_path / "m", num_hidden_layers=1000000)
    res = subprocess.run(
        [sys.executable, "-m", "staleflow", "check", "--preset", "tiny", "--model.path", str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_hidden_layers" in lines[0], res.stderr[-2000:]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=10,
)
_CONFIG_KEYS = [
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "attention_bias",
    "hidden_act",
    "model_type",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.dictionaries(st.sampled_from(_CONFIG_KEYS), _JSON | st.integers(0, 5000), max_size=4),
    drop=st.lists(st.sampled_from(_CONFIG_KEYS), max_size=2),
    raw=st.none() | st.binary(max_size=40),
)
def test_fuzz_reader_model_config(tmp_path_factory, tiny_folder, changes, drop, raw):
    """Any field set to any JSON value (or random bytes as config.json): ModelArgs whose meta model
    builds, or one ModelLoadError; never another exception."""
    folder = tmp_path_factory.mktemp("cfg")
    d = json.loads((tiny_folder / "config.json").read_text())
    d.update(changes)
    for key in drop:
        d.pop(key, None)
    (folder / "config.json").write_bytes(raw if raw is not None else json.dumps(d).encode())
    try:
        args = read_model_args(folder)
    except ModelLoadError as e:
        assert "\n" not in str(e)
        return
    shapes = hf.expected_shapes(args)
    assert len(shapes) > args.num_layers


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]),
    value=_JSON,
    key=st.sampled_from(["tokenizer_class", "chat_template", "model_max_length", "auto_map", "added_tokens_decoder"]),
    raw=st.none() | st.binary(max_size=40),
)
def test_fuzz_reader_tokenizer_config(tmp_path_factory, name, value, key, raw):
    folder = tmp_path_factory.mktemp("tok")
    (folder / name).write_bytes(raw if raw is not None else json.dumps({key: value}).encode())
    try:
        check_tokenizer_config(folder)
    except ModelLoadError as e:
        assert "\n" not in str(e) and name in str(e)
