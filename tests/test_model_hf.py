"""Model vs transformers: parity of log-probs, checkpoint round trips, bad checkpoint folders.

transformers is the reference: a tiny random HF model is saved with save_pretrained, loaded with
our load_model, and both run the same sequences. fp32 must agree to 1e-4 in log-prob (the
acceptance bar) and fp64 to 1e-10 (so a small systematic error cannot hide in fp32 noise).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from staleflow.model import (
    CausalLM,
    ModelArgs,
    ModelLoadError,
    PackedAttention,
    lazy_model,
    load_model,
    resolve_model_path,
    save_hf,
)
from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions

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
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
LENGTHS = [7, 12, 3, 9]


def hf_model(kind: str, tie: bool = False, rope: dict | None = None, max_pos: int = 256, seed: int = 0):
    """A random transformers model whose every parameter (norms and biases too) is non-trivial."""
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    kw = dict(SHAPE, tie_word_embeddings=tie, max_position_embeddings=max_pos, eos_token_id=2, bos_token_id=1)
    if rope is not None:
        kw["rope_parameters"] = dict(rope)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def sequences(vocab: int, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def ours_logprobs(model: CausalLM, seqs) -> torch.Tensor:
    cu = cu_seqlens_from_lengths([len(s) for s in seqs])
    with torch.no_grad():
        h = model(torch.cat(seqs), packed_positions(cu), PackedAttention(cu))
        return torch.log_softmax(model.compute_logits(h), -1)


def hf_logprobs(model, seqs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([torch.log_softmax(model(s[None]).logits[0], -1) for s in seqs])


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


CASES = {
    "qwen2": dict(kind="qwen2"),
    "qwen2-tied": dict(kind="qwen2", tie=True),
    "qwen3": dict(kind="qwen3"),
    "qwen3-tied-yarn": dict(
        kind="qwen3",
        tie=True,
        rope={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8},
    ),
    "llama-llama3": dict(kind="llama", rope=LLAMA3),
    "llama-linear": dict(kind="llama", rope={"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0}),
    # max_position_embeddings 8 < sequence length 12: the NTK base really grows
    "llama-dynamic": dict(kind="llama", rope={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, max_pos=8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logprob_parity_with_transformers(case, tmp_path):
    ref = hf_model(**CASES[case])
    ref.save_pretrained(tmp_path)
    seqs = sequences(SHAPE["vocab_size"])
    ours = load_model(str(tmp_path))
    assert ours.args.rope_type == (CASES[case].get("rope") or {}).get("rope_type", "default")
    if case == "llama-dynamic":  # HF dynamic RoPE depends on the longest sequence seen: run one at a time
        lp = torch.cat([ours_logprobs(ours, [s]) for s in seqs])
    else:
        lp = ours_logprobs(ours, seqs)
    assert max_diff(lp, hf_logprobs(ref, seqs)) <= 1e-4
    ours64 = load_model(str(tmp_path), dtype=torch.float64)
    ref64 = ref.double()
    lp64 = (
        torch.cat([ours_logprobs(ours64, [s]) for s in seqs])
        if case == "llama-dynamic"
        else ours_logprobs(ours64, seqs)
    )
    # HF grows the dynamic NTK base with float32 tensor arithmetic, we in Python floats
    assert max_diff(lp64, hf_logprobs(ref64, seqs)) <= (1e-6 if case == "llama-dynamic" else 1e-10)


def test_llama3_scaling_matters(tmp_path):
    """The llama3 case is not vacuous: the same weights without scaling give other log-probs."""
    ref = hf_model("llama", rope=LLAMA3)
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    seqs = sequences(SHAPE["vocab_size"])
    assert max_diff(ours_logprobs(load_model(str(tmp_path)), seqs), hf_logprobs(ref, seqs)) > 1e-3


@pytest.mark.parametrize("arch, tie", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_save_hf_loads_in_transformers_with_identical_logits(arch, tie, tmp_path):
    args = ModelArgs(
        architecture=arch,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=tie,
        eos_token_ids=[2],
        rope_scaling=LLAMA3 if arch == "llama" else None,
    )
    ours = CausalLM(args).init_weights(std=0.1, seed=3)
    save_hf(ours, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(ref).__name__ == ModelArgs.to_hf_config(args)["architectures"][0]
    seqs = sequences(128, seed=1)
    cu = cu_seqlens_from_lengths([len(s) for s in seqs])
    with torch.no_grad():
        ours_logits = ours.compute_logits(ours(torch.cat(seqs), packed_positions(cu), PackedAttention(cu)))
        ref_logits = torch.cat([ref(s[None]).logits[0] for s in seqs])
    assert max_diff(ours_logits, ref_logits) <= 1e-5
    again = load_model(str(tmp_path))
    assert again.args == args
    for name, t in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_sharded_checkpoints_load_both_ways(tmp_path):
    ref = hf_model("qwen3")
    ref.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    seqs = sequences(SHAPE["vocab_size"])
    ours = load_model(str(tmp_path / "hf"))
    assert max_diff(ours_logprobs(ours, seqs), hf_logprobs(ref, seqs)) <= 1e-4

    save_hf(ours, tmp_path / "ours", max_shard_bytes=50_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours.state_dict()) and len(set(index["weight_map"].values())) > 2
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert max_diff(hf_logprobs(back, seqs), hf_logprobs(ref, seqs)) <= 1e-6
    # re-saving unsharded removes the stale shards, so the folder stays loadable
    save_hf(ours, tmp_path / "ours")
    assert [p.name for p in (tmp_path / "ours").glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "ours" / "model.safetensors.index.json").exists()
    load_model(str(tmp_path / "ours"))


def test_lazy_model_is_on_meta_and_streams_the_loaded_weights_one_at_a_time(tmp_path):
    hf_model("qwen3").save_pretrained(tmp_path, max_shard_size="60KB")
    eager = load_model(str(tmp_path)).state_dict()
    model, weights = lazy_model(str(tmp_path))
    assert all(p.is_meta for p in model.parameters()) and set(model.state_dict()) == set(eager)
    seen = []
    for name, t in weights():  # a generator: one tensor read per step, none kept by the loader
        assert name not in seen and t.device.type == "cpu" and t.dtype == torch.float32
        torch.testing.assert_close(t, eager[name], atol=0, rtol=0)
        seen.append(name)
    assert sorted(seen) == sorted(eager)


def test_lazy_model_names_missing_and_unexpected_tensors_before_any_model_is_built(tmp_path):
    """From the safetensors headers alone (hf.check_config_against_headers), before the meta model."""
    hf_model("qwen2").save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.attn.q.weight"] = sd.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"1 missing tensors \['model.layers.0.self_attn.q_proj.weight'\]"):
        lazy_model(str(tmp_path))


def test_bf16_load_casts_parameters(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path)
    m = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    cu = cu_seqlens_from_lengths([5])
    h = m(torch.arange(5), packed_positions(cu), PackedAttention(cu))
    assert h.dtype == torch.bfloat16 and torch.isfinite(h).all()


# ---------------------------------------------------------------- bad input


def test_missing_folder_names_the_path_and_the_aliases(tmp_path):
    with pytest.raises(ModelLoadError, match=r"'/no/such/model' does not exist.*smollm2-135m"):
        load_model("/no/such/model")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_folder_without_safetensors(tmp_path):
    hf_model("qwen2").config.to_json_file(tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load_model(str(tmp_path))


def test_unsupported_architecture_in_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(str(tmp_path))


def test_wrong_tensor_names_are_listed(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.attn.q.weight"] = sd.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError,
        match=r"1 missing tensors \['model.layers.0.self_attn.q_proj.weight'\], "
        r"1 unexpected tensors \['model.layers.0.attn.q.weight'\]",
    ):
        load_model(str(tmp_path))


def test_shape_mismatch_names_the_tensor(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"mlp\.\w+_proj\.weight.*has shape \(\d+, \d+\), config.json implies.*100"
    ):
        load_model(str(tmp_path))


def test_missing_shard_named(tmp_path):
    hf_model("llama").save_pretrained(tmp_path, max_shard_size="60KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load_model(str(tmp_path))


def test_resolve_model_path_passes_folders_through(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
