"""Tokenizer loading: transformers' AutoTokenizer from a model folder or alias.

    tok = load_tokenizer("smollm2-135m")
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)

The alias folders carry SmolLM2's tokenizer and chat template (`<|im_start|>` ... `<|im_end|>`).
A base-model folder may have no chat template: `tok.chat_template` is then None. A folder's code is
never run: trust_remote_code=False, and a tokenizer_config.json with auto_map is refused first.
"""

from __future__ import annotations

from pathlib import Path

from staleflow.model.hf import ModelLoadError, check_tokenizer_config
from staleflow.model.loader import resolve_model_path


def load_tokenizer(folder: str):
    """AutoTokenizer for a HF model folder or alias; one-line ModelLoadError if it has none."""
    from transformers import AutoTokenizer

    path = Path(resolve_model_path(folder))
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(
            f"no tokenizer files (tokenizer.json, tokenizer.model or vocab.json) in {str(path)!r}: "
            "copy them from the original model folder"
        )
    check_tokenizer_config(path)  # typed fields; auto_map (custom code) refused in one line
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
