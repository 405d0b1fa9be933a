"""Mixture of experts (Qwen3-MoE): our packed forward against transformers' (packed and padded
batches), the router's auxiliary loss, export back to transformers, the built-in engine's decode,
a trainer step's routing metrics, the memory plan of the paper's Qwen3-30B-A3B, bad configs.

The reference folders are tiny random Qwen3-MoE models made with transformers (4-8 experts, top-2,
one dense layer among sparse ones), saved with save_pretrained: the Hub's per-expert tensor names.
The two-rank FSDP2 test and the 2-step torchrun run are in test_moe_distributed.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_helpers import assert_same, capture_grads, lipschitz_adam, random_batch  # noqa: E402

from staleflow.config import TrainConfig  # noqa: E402
from staleflow.model import CausalLM, ModelArgs, ModelConfigError, PackedAttention, load_folder, save_hf  # noqa: E402
from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions  # noqa: E402
from staleflow.model.moe import router_aux_loss  # noqa: E402
from staleflow.train.trainer import Trainer  # noqa: E402

transformers = pytest.importorskip("transformers")

HF_SHAPE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
VARIANTS = {
    # Qwen3-30B-A3B's routing (renormalised top-k) with layer 1 dense (mlp_only_layers)
    "norm-mlp-only": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
    # transformers' default (no renormalisation), every second layer sparse (decoder_sparse_step)
    "raw-step2": dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2),
}


def make_hf(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**HF_SHAPE, **VARIANTS[variant])
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # peaked logits and routers that really choose (std 0.02 would be near uniform)
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for variant in VARIANTS:
        folder = tmp_path_factory.mktemp(variant)
        hf = make_hf(variant)
        hf.save_pretrained(folder)
        out[variant] = (hf, str(folder))
    return out


def packed_logits(model: CausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    cu = cu_seqlens_from_lengths([len(s) for s in seqs])
    with torch.no_grad():
        logits = model.compute_logits(model(torch.cat(seqs), packed_positions(cu), PackedAttention(cu)))
    return list(logits.split([len(s) for s in seqs]))


SEQS = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 13, 2, 21)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_packed_forward_matches_transformers_packed_and_padded(folders, variant):
    hf, folder = folders[variant]
    ours = load_folder(folder)
    assert ours.args.architecture == "qwen3_moe" and ours.args.is_moe
    assert [layer.sparse for layer in ours.model.layers] == [
        hf.model.layers[i].mlp.__class__.__name__ != "Qwen3MoeMLP" for i in range(3)
    ]
    got = packed_logits(ours, SEQS)
    longest = max(len(s) for s in SEQS)
    ids = torch.zeros(len(SEQS), longest, dtype=torch.long)
    mask = torch.zeros(len(SEQS), longest, dtype=torch.long)
    for i, s in enumerate(SEQS):  # right padding: a padded batch, every sequence at positions 0..L-1
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad():
        padded = hf(ids, attention_mask=mask).logits
    for i, s in enumerate(SEQS):
        with torch.no_grad():
            alone = hf(s[None]).logits[0]
        assert (got[i] - alone).abs().max() <= 1e-4
        assert (got[i] - padded[i, : len(s)]).abs().max() <= 1e-4
    # not vacuous: the routers do choose (several experts used, not all tokens alike)
    x = torch.randn(50, 32)
    _, idx, _ = next(layer for layer in ours.model.layers if layer.sparse).mlp.route(x)
    assert len(set(idx.reshape(-1).tolist())) == ours.args.num_experts


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_router_aux_loss_matches_transformers(folders, variant):
    hf, folder = folders[variant]
    ours = load_folder(folder)
    s = SEQS[3]
    with torch.no_grad():
        ref = hf(s[None], output_router_logits=True).aux_loss
        cu = cu_seqlens_from_lengths([len(s)])
        _, stats = ours(s, packed_positions(cu), PackedAttention(cu), router_stats=True)
    n_sparse = sum(layer.sparse for layer in ours.model.layers)
    assert stats.shape == (n_sparse, 2, ours.args.num_experts)
    assert stats[:, 0].sum() == len(s) * ours.args.num_experts_per_tok * n_sparse  # every token routed k times
    torch.testing.assert_close(router_aux_loss(stats, ours.args.num_experts_per_tok), ref.float(), atol=1e-5, rtol=1e-5)


def tiny_moe_args(**kw) -> ModelArgs:
    base = dict(
        architecture="qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        eos_token_ids=[2],
    )
    return ModelArgs(**{**base, **kw})


def test_moe_export_loads_in_transformers_with_identical_logits(tmp_path):
    ours = CausalLM(tiny_moe_args()).init_weights(std=0.2, seed=5)
    save_hf(ours, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.num_experts == 4 and hf.config.norm_topk_prob and hf.config.mlp_only_layers == [1]
    for s, got in zip(SEQS, packed_logits(ours, [t % 64 for t in SEQS])):
        with torch.no_grad():
            ref = hf((s % 64)[None]).logits[0]
        assert (ref - got).abs().max() <= 1e-5
    again = load_folder(tmp_path / "hf")  # and back into ours, tensor for tensor
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


def test_moe_config_fields_are_read_in_both_spellings_and_checked():
    d = tiny_moe_args().to_hf_config()
    assert ModelArgs.from_hf_config(d).num_experts == 4
    d2 = {k: v for k, v in d.items() if k != "num_experts"} | {"num_local_experts": 4}  # transformers 5's spelling
    assert ModelArgs.from_hf_config(d2) == ModelArgs.from_hf_config(d)
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        ModelArgs.from_hf_config(d | {"num_experts_per_tok": 5})
    with pytest.raises(ModelConfigError, match="shared experts"):
        ModelArgs.from_hf_config(d | {"shared_expert_intermediate_size": 128})
    with pytest.raises(ModelConfigError, match="mlp_only_layers"):
        ModelArgs.from_hf_config(d | {"mlp_only_layers": [7]})
    with pytest.raises(ModelConfigError, match="num_experts"):
        ModelArgs(architecture="qwen3", num_experts=4)
    dense = ModelArgs.from_hf_config(d | {"num_experts": 0})  # transformers builds every layer dense then
    assert not dense.is_moe and not CausalLM(dense).model.layers[0].sparse


def test_moe_active_parameters_count_k_of_e_experts():
    m = CausalLM(tiny_moe_args())
    per_expert = 3 * 16 * 32
    assert m.num_params() - m.num_active_params() == 2 * (4 - 2) * per_expert  # two sparse layers


# ---- the built-in engine ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["mirror", "gather", "triton"])  # triton: the CUDA default, interpreted
def test_moe_engine_greedy_matches_transformers_and_its_logprobs_the_forward(folders, backend):
    from staleflow.rollout import BuiltinEngine, Request, SamplingParams

    hf, folder = folders["norm-mlp-only"]
    model = load_folder(folder)
    engine = BuiltinEngine(
        load_folder(folder),
        max_kv_tokens=1024,
        block_size=4,
        prefill_chunk_tokens=8,
        max_model_len=128,
        decode_backend=backend,
    )
    assert engine.model.model.layers[0].mlp.experts[0].gate_up_w is not None  # experts fused like dense MLPs
    prompts = [s.tolist() for s in SEQS[:3]]
    outs = engine.generate(
        [Request(i, p, SamplingParams(temperature=0, max_new_tokens=8)) for i, p in enumerate(prompts)]
    )
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
            )
        resp = out.tokens.response_ids
        assert resp == ref[0, len(p) :].tolist()
        full = packed_logits(model, [torch.tensor(p + resp)])[0][len(p) - 1 : -1]
        want = torch.log_softmax(full, -1).gather(1, torch.tensor(resp)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.tokens.behaviour_logprobs), want, atol=1e-4, rtol=1e-4)


def test_moe_engine_loads_new_weights_in_place_into_fused_experts(folders):
    from staleflow.rollout import BuiltinEngine, Request, SamplingParams

    _, folder = folders["norm-mlp-only"]
    engine = BuiltinEngine(load_folder(folder), max_kv_tokens=512, block_size=4, max_model_len=64)
    fused = engine.model.model.layers[2].mlp.experts[3].gate_up_w
    ref = CausalLM(engine.model.args).init_weights(std=0.2, seed=9)
    engine.load_weights(ref.state_dict(), version=1)
    assert engine.model.model.layers[2].mlp.experts[3].gate_up_w is fused  # in place: same storage
    assert torch.equal(fused[:16], ref.model.layers[2].mlp.experts[3].gate_proj.weight)
    p = SEQS[1].tolist()
    out = engine.generate([Request(0, p, SamplingParams(temperature=0, max_new_tokens=6))])[0]
    logits = packed_logits(ref, [torch.tensor(p + out.tokens.response_ids)])[0][len(p) - 1 : -1]
    assert out.tokens.response_ids == logits.argmax(-1).tolist()
    assert out.tokens.versions == [1] * 6


def test_moe_cuda_graphs_are_refused_in_one_line_before_any_gpu():
    from staleflow.rollout.cuda_graphs import check_cuda_graphs
    from staleflow.rollout.engine import EngineError

    with pytest.raises(EngineError, match="mixture-of-experts"):
        check_cuda_graphs(torch.device("cuda"), "triton", tiny_moe_args())
    check_cuda_graphs(torch.device("cuda"), "triton", tiny_moe_args(architecture="qwen3", num_experts=0))


# ---- the trainer --------------------------------------------------------------------------------


def test_moe_trainer_step_reports_tokens_per_expert_and_the_aux_loss():
    batch = random_batch(seed=1, groups=3, vocab=64)
    out = {}
    for coef in (0.0, 0.5):
        t = Trainer(
            CausalLM(tiny_moe_args()).init_weights(std=0.2, seed=0),
            TrainConfig(lr=1e-2, micro_batch_tokens=20, router_aux_coef=coef),
        )
        before = {n: p.detach().clone() for n, p in t.model.named_parameters() if n.endswith("mlp.gate.weight")}
        out[coef] = t.step(*batch)
        out[coef]["gate_moved"] = sum(
            (p - before[n]).abs().sum().item() for n, p in t.model.named_parameters() if n in before
        )
    m = out[0.0]
    tokens = sum(t.seq_len for g in batch[1] for t in g if t.response_ids)
    assert m["moe_tokens_per_expert_mean"] * 4 * 2 == pytest.approx(tokens * 2 * 2)  # E x sparse layers = T x k x L
    assert m["moe_tokens_per_expert_min"] <= m["moe_tokens_per_expert_mean"] <= m["moe_tokens_per_expert_max"]
    assert m["moe_load_imbalance"] >= 1 and m["moe_aux_loss"] >= 1.0 - 1e-6  # k/E-uniform load is the minimum
    assert out[0.5]["moe_aux_loss"] == pytest.approx(m["moe_aux_loss"])  # same weights, same routing
    assert out[0.5]["loss"] == pytest.approx(m["loss"]) and out[0.5]["gate_moved"] != m["gate_moved"]


def test_moe_micro_batch_split_leaves_the_step_unchanged_without_aux_loss():
    batch = random_batch(seed=2, groups=4, vocab=64)
    runs = []
    for budget in (10_000, 15):
        t = Trainer(
            CausalLM(tiny_moe_args()).init_weights(std=0.2, seed=3), TrainConfig(lr=1e-2, micro_batch_tokens=budget)
        )
        lipschitz_adam(t)
        grads = capture_grads(t)
        runs.append((t.step(*batch), grads[0], t.full_state_dict()))
    (m1, g1, s1), (m2, g2, s2) = runs
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    assert m1["moe_tokens_per_expert_max"] == m2["moe_tokens_per_expert_max"]  # routing does not depend on packing
    assert all(g is not None for g in g2.values())  # every expert has a gradient (zero where it got no token)
    assert_same(g1, g2)
    assert_same(s1, s2, atol=1e-5)


def test_router_aux_coef_on_a_dense_model_is_refused():
    from test_train_helpers import tiny_model

    with pytest.raises(ValueError, match="router-aux-coef"):
        Trainer(tiny_model(), TrainConfig(router_aux_coef=0.01))


# ---- the memory plan ----------------------------------------------------------------------------


def test_moe_plan_of_qwen3_30b_a3b_counts_active_and_total_parameters(capsys):
    from staleflow.plan.cli import main

    flags = ["--preset", "gpu-7b", "--model.path", "Qwen/Qwen3-30B-A3B", "--gpu-memory-gib", "80"]
    code = main([*flags, "--nproc", "8", "--rollout.ranks", "2", "--rollout.max-kv-tokens", "65536"])
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert last["params_b"] == pytest.approx(30.53, abs=0.01) and last["active_params_b"] == pytest.approx(
        3.35, abs=0.01
    )
    assert "30.53B params, 3.35B active per token" in out[0]
    # 6 trainer GPUs cannot hold 30.5B parameters' fp32 weights, gradients and AdamW state (16 bytes each)
    assert code == 1 and last["fits"] is False
    trainer = [line.split() for line in out if line.split()[1:2] == ["trainer"]]
    assert trainer and all(float(row[-1]) > 80 for row in trainer)
    assert any("does not capture mixture-of-experts" in line for line in out)


def test_moe_plan_counts_a_sparse_layers_activations_and_engine_workspace():
    from staleflow.config import RolloutConfig
    from staleflow.plan.estimate import engine_workspace, layer_saved_bytes

    args = tiny_moe_args(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64)
    dense = layer_saved_bytes(args, 256, torch.float32, expand_kv=False, layer_idx=1)
    sparse = layer_saved_bytes(args, 256, torch.float32, expand_kv=False, layer_idx=0)
    assert sparse > dense  # k gathered rows and k experts' SwiGLU per token, vs one MLP of width 64
    rc = RolloutConfig(max_running=8, prefill_chunk_tokens=64)
    assert engine_workspace(args, rc, 4) > engine_workspace(args.replace(num_experts_per_tok=1), rc, 4)


def test_moe_activation_checkpointing_recomputes_routing_and_the_aux_loss_exactly():
    grads = []
    for ac in ("off", "on"):
        cfg = TrainConfig(lr=1e-2, micro_batch_tokens=30, router_aux_coef=0.1, activation_checkpointing=ac)
        t = Trainer(CausalLM(tiny_moe_args()).init_weights(std=0.2, seed=0), cfg)
        seen = capture_grads(t)
        t.step(*random_batch(seed=1, groups=3, vocab=64))
        grads.append(seen[0])
    assert t.model.gradient_checkpointing and any(n.endswith("mlp.gate.weight") for n in grads[1])
    assert_same(grads[0], grads[1], atol=0)
