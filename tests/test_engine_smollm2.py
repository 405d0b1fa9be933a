"""Built-in engine on the real SmolLM2-135M-Instruct (alias smollm2-135m): greedy output equals
transformers' greedy generate token for token, on chat prompts batched together."""

import pytest
import torch

from staleflow.model import load_model, load_tokenizer, resolve_model_path
from staleflow.rollout import BuiltinEngine, Request, SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

QUESTIONS = ["What is 7 + 5?", "Name a colour of the sky.", "Write one word that rhymes with cat."]
NEW_TOKENS = 10


def test_smollm2_greedy_matches_transformers_generate():
    folder = resolve_model_path("smollm2-135m")
    tok = load_tokenizer(folder)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    engine = BuiltinEngine(
        load_model(folder), max_kv_tokens=2048, block_size=16, prefill_chunk_tokens=64, max_model_len=256
    )
    outs = engine.generate(
        [Request(i, p, SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)) for i, p in enumerate(prompts)]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = engine.model.args.eos_token_ids
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
            )
        assert out.tokens.response_ids == ref[0, len(p) :].tolist()
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
