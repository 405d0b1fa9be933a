"""Model names -> folders -> models: an alias (built into the cache on first use) or a HF folder.

model = load_model("smollm2-135m")                  # alias or folder, fp32 on CPU
model = load_model("/ckpt/qwen3-8b", torch.bfloat16, "cuda")
"""

from __future__ import annotations

from pathlib import Path

import torch

from staleflow.model.aliases import ALIASES, ensure_alias
from staleflow.model.hf import ModelLoadError, lazy_folder, load_folder
from staleflow.model.transformer import CausalLM


def resolve_model_path(path_or_alias: str, verify: bool = False) -> str:
    """An alias (smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3, tiny-qwen3-moe) or a folder -> an existing folder.
    ``verify``: an alias's cached files are hashed against their build marker (rebuilt if changed)."""
    if path_or_alias in ALIASES:
        return str(ensure_alias(path_or_alias, verify))
    folder = Path(path_or_alias).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"model folder {path_or_alias!r} does not exist: give a Hugging Face model folder "
            f"or one of the aliases {sorted(ALIASES)}"
        )
    return str(folder)


def load_model(path_or_alias: str, dtype: torch.dtype = torch.float32, device="cpu") -> CausalLM:
    """Build a CausalLM from a HF folder or alias and load its weights (cast to dtype, on device)."""
    return load_folder(resolve_model_path(path_or_alias), dtype, device)


def lazy_model(path_or_alias: str, dtype: torch.dtype = torch.float32):
    """(the model on the meta device, a function streaming its weights on CPU): see hf.lazy_folder."""
    return lazy_folder(resolve_model_path(path_or_alias), dtype, "cpu")
