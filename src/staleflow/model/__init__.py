"""staleflow.model: our Llama / Qwen2 / Qwen3 implementation with HF checkpoints and packed attention.

    from staleflow.model import load_model, PackedAttention, load_tokenizer
    from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions

    model = load_model("smollm2-135m")            # or a HF folder, or tiny-llama/qwen2/qwen3
    cu = cu_seqlens_from_lengths([len(a), len(b)])
    hidden = model(torch.cat([a, b]), packed_positions(cu), PackedAttention(cu))  # [T, H]

See docs/model.md.
"""

from staleflow.model.args import ModelArgs, ModelConfigError
from staleflow.model.attention import PackedAttention, cu_seqlens_from_lengths, packed_positions
from staleflow.model.hf import ModelLoadError, load_folder, save_hf
from staleflow.model.loader import lazy_model, load_model, resolve_model_path
from staleflow.model.tokenizer import load_tokenizer
from staleflow.model.transformer import CausalLM

__all__ = [
    "CausalLM",
    "ModelArgs",
    "ModelConfigError",
    "ModelLoadError",
    "PackedAttention",
    "cu_seqlens_from_lengths",
    "packed_positions",
    "lazy_model",
    "load_folder",
    "load_model",
    "save_hf",
    "resolve_model_path",
    "load_tokenizer",
]
