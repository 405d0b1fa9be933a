"""Model unit specs: ModelArgs <-> HF config, packed attention helpers, packed == alone, gradients.

No checkpoint files here (see test_model_hf.py for transformers parity and I/O): tiny random
models built from ModelArgs, fp64 where exactness is asserted.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.model import CausalLM, ModelArgs, ModelConfigError, PackedAttention
from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions
from staleflow.model.transformer import rope_inv_freq

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def tiny_model(arch="llama", dtype=torch.float64, tie=False, seed=0, **kw) -> CausalLM:
    args = ModelArgs(architecture=arch, tie_word_embeddings=tie, **{**TINY, **kw})
    model = CausalLM(args).init_weights(std=0.2, seed=seed)
    with torch.no_grad():  # non-trivial norms and biases, so a wrong use of them shows
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.to(dtype)


# ---------------------------------------------------------------- ModelArgs


def test_from_hf_config_reads_transformers5_and_transformers4_rope_spellings():
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        eos_token_id=[7, 8],
        bos_token_id=1,
    )
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    v5 = ModelArgs.from_hf_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    v4 = ModelArgs.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    assert v5 == v4
    assert v5.rope_theta == 5e5 and v5.rope_type == "llama3" and v5.rope_scaling["factor"] == 8.0
    assert v5.head_dim == 16 and v5.eos_token_ids == [7, 8] and not v5.qk_norm and not v5.attention_bias


def test_hf_config_round_trip_and_family_features():
    for arch, hf in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        args = ModelArgs(
            architecture=arch, rope_scaling={"rope_type": "linear", "factor": 2.0}, eos_token_ids=[3], **TINY
        )
        d = args.to_hf_config()
        assert d["architectures"] == [hf] and d["eos_token_id"] == 3
        assert ModelArgs.from_hf_config(d) == args
    assert ModelArgs(architecture="qwen2", **TINY).attention_bias  # Qwen2 always has q/k/v bias
    assert ModelArgs(architecture="qwen3", **TINY).qk_norm
    assert not ModelArgs(architecture="llama", qk_norm=True, **TINY).qk_norm


def test_unsupported_architecture_error_lists_supported():
    with pytest.raises(
        ModelConfigError, match=r"MistralForCausalLM.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    ):
        ModelArgs.from_hf_config({"architectures": ["MistralForCausalLM"]})


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
        ({"num_key_value_heads": 3}, "num_kv_heads=3"),
    ],
)
def test_unsupported_features_raise_naming_the_value(bad, match):
    d = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(ModelConfigError, match=match):
        ModelArgs.from_hf_config({**d, **bad})


# ---------------------------------------------------------------- packed helpers


def test_cu_seqlens_and_positions_examples():
    cu = cu_seqlens_from_lengths([3, 0, 2])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 5]
    assert packed_positions(cu).tolist() == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        cu_seqlens_from_lengths([2, -1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedAttention(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="backend='bogus'"):
        PackedAttention(cu, backend="bogus")
    with pytest.raises(ValueError, match="needs CUDA"):
        PackedAttention(cu, backend="flash").resolve_backend(torch.device("cpu"))


@given(st.lists(st.integers(0, 9), min_size=1, max_size=6))
def test_packed_positions_count_within_each_sequence(lengths):
    pos = packed_positions(cu_seqlens_from_lengths(lengths)).tolist()
    assert pos == [i for n in lengths for i in range(n)]


def reference_attention(q, k, v, lengths):
    """fp64 loop: softmax(q k^T / sqrt(d)) v per sequence and head, causal."""
    out, start, rep = [], 0, q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = torch.einsum("thd,shd->hts", qs, ks) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hts,shd->thd", s.softmax(-1), vs))
        start += n
    return torch.cat(out) if out else q.new_zeros(q.shape)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=1, max_size=5), st.sampled_from([1, 5, 4096]))
def test_packed_attention_matches_per_sequence_reference(lengths, chunk):
    g = torch.Generator().manual_seed(sum(lengths))
    T = sum(lengths)
    q = torch.randn(T, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(T, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = PackedAttention(cu_seqlens_from_lengths(lengths), sdpa_chunk_tokens=chunk)(0, q, k, v)
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference_attention(q, k, v, lengths), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- CausalLM


def test_parameter_names_are_hugging_face_names():
    names = set(tiny_model("qwen3").state_dict())
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    } <= names
    assert "model.layers.0.self_attn.q_proj.bias" not in names
    qwen2 = set(tiny_model("qwen2", tie=True).state_dict())
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2 and "model.layers.0.self_attn.o_proj.bias" not in qwen2
    assert "lm_head.weight" not in qwen2 and not any("norm" in n for n in qwen2 if "self_attn" in n)


def test_tied_lm_head_is_the_embedding():
    m = tiny_model("llama", tie=True)
    assert m.lm_head_weight is m.model.embed_tokens.weight
    h = torch.randn(3, TINY["hidden_size"], dtype=torch.float64)
    logits = m.compute_logits(h)
    assert logits.dtype == torch.float64 and logits.shape == (3, TINY["vocab_size"])
    torch.testing.assert_close(logits, h @ m.model.embed_tokens.weight.T)
    m16 = m.to(torch.bfloat16)
    assert m16.compute_logits(h.to(torch.bfloat16)).dtype == torch.float32  # low precision -> float32


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 10), min_size=2, max_size=5))
def test_packed_batch_equals_each_sequence_alone(arch, lengths):
    model = tiny_model(arch, tie=arch == "llama")
    g = torch.Generator().manual_seed(len(lengths))
    seqs = [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in lengths]
    cu = cu_seqlens_from_lengths(lengths)
    with torch.no_grad():
        packed = model(torch.cat(seqs), packed_positions(cu), PackedAttention(cu))
        alone = [model(s, torch.arange(len(s)), PackedAttention(cu_seqlens_from_lengths([len(s)]))) for s in seqs]
    assert packed.shape == (sum(lengths), TINY["hidden_size"])
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-12)


def test_packed_gradients_equal_sum_of_per_sequence_gradients_and_checkpointing_is_exact():
    lengths = [4, 7, 2]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in lengths]
    targets = [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in lengths]

    def grads(model, pieces):
        model.zero_grad()
        for ids, tgt in pieces:
            cu = cu_seqlens_from_lengths([len(i) for i in ids])
            h = model(torch.cat(ids), packed_positions(cu), PackedAttention(cu))
            loss = torch.nn.functional.cross_entropy(model.compute_logits(h).double(), torch.cat(tgt), reduction="sum")
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    model = tiny_model("qwen3")
    packed = grads(model, [(seqs, targets)])
    alone = grads(model, [([s], [t]) for s, t in zip(seqs, targets)])
    model.gradient_checkpointing = True
    ckpt = grads(model, [(seqs, targets)])
    for n in packed:
        torch.testing.assert_close(packed[n], alone[n], rtol=1e-9, atol=1e-11, msg=n)
        torch.testing.assert_close(packed[n], ckpt[n], rtol=0, atol=0, msg=n)


def test_forward_rejects_batched_inputs():
    m = tiny_model("llama")
    with pytest.raises(ValueError, match=r"1-D \[T\]"):
        m(
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2, 3, dtype=torch.long),
            PackedAttention(torch.tensor([0, 6])),
        )


def test_rope_scaling_variants_change_frequencies_as_specified():
    base = ModelArgs(**TINY)
    f0, s0 = rope_inv_freq(base)
    torch.testing.assert_close(f0, 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    lin, _ = rope_inv_freq(base.replace(rope_scaling={"rope_type": "linear", "factor": 4.0}))
    torch.testing.assert_close(lin, f0 / 4)
    dyn = base.replace(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.testing.assert_close(rope_inv_freq(dyn, seq_len=64)[0], f0)  # inside the trained window: unchanged
    assert (rope_inv_freq(dyn, seq_len=512)[0][1:] < f0[1:]).all()  # beyond: lower frequencies
    l3, s3 = rope_inv_freq(
        base.replace(
            rope_theta=5e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    )
    l3_plain, _ = rope_inv_freq(base.replace(rope_theta=5e5))
    assert l3[0] == l3_plain[0] and torch.isclose(l3[-1], l3_plain[-1] / 8)  # high kept, low divided
    _, sy = rope_inv_freq(
        base.replace(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    )
    assert s0 == 1.0 and sy == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def test_load_weights_copies_in_place_and_rejects_bad_names():
    src, dst = tiny_model("qwen2", tie=True, seed=1), tiny_model("qwen2", tie=True, seed=2)
    before = {n: p for n, p in dst.named_parameters()}
    items = list(src.state_dict().items()) + [("lm_head.weight", src.lm_head_weight)]
    assert dst.load_weights(items) == len(before)
    for n, p in dst.named_parameters():
        assert p is before[n] and torch.equal(p, src.state_dict()[n])
    with pytest.raises(ValueError, match="'model.layers.9.mlp.up_proj.weight' is not a parameter"):
        dst.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        dst.load_weights([("model.norm.weight", torch.zeros(3))])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_inference_layout_keeps_outputs_names_and_in_place_loads(arch):
    model, ref = tiny_model(arch, seed=3), tiny_model(arch, seed=3)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    model.fuse_projections().fuse_projections()  # idempotent
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert model.model.layers[0].self_attn.qkv_w is not None
    assert all(p.is_contiguous() for p in model.parameters())  # row blocks: pulls are plain copies
    lengths = [3, 7, 1]
    ids = torch.randint(0, TINY["vocab_size"], (sum(lengths),), generator=torch.Generator().manual_seed(0))
    cu = cu_seqlens_from_lengths(lengths)

    def run(m):
        with torch.no_grad():
            return m(ids, packed_positions(cu), PackedAttention(cu))

    torch.testing.assert_close(run(model), run(ref), rtol=0, atol=1e-12)
    # in-place loads reach the fused matrices: load another model's weights into both
    other = tiny_model(arch, seed=4)
    model.load_weights(other.state_dict().items())
    ref.load_weights(other.state_dict().items())
    torch.testing.assert_close(run(model), run(ref), rtol=0, atol=1e-12)
    a = model.model.layers[1].self_attn
    assert torch.equal(a.qkv_w[: a.n_heads * a.head_dim], other.state_dict()["model.layers.1.self_attn.q_proj.weight"])
