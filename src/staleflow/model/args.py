"""ModelArgs: the architecture description of a Llama / Qwen2 / Qwen3 decoder.

Built from a Hugging Face `config.json` dict with `ModelArgs.from_hf_config(d)` and written
back with `.to_hf_config()`, so a folder we save loads in `transformers` unchanged. Both the
transformers-4 (`rope_theta` + `rope_scaling`) and transformers-5 (`rope_parameters`) spellings
of RoPE settings are read; both are written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_HF_NAME = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A config.json this implementation cannot run (unsupported architecture or feature)."""


@dataclass
class ModelArgs:
    """Architecture hyper-parameters (names follow the paper-free HF meaning, not HF spelling)."""

    architecture: Literal["llama", "qwen2", "qwen3"] = "llama"
    vocab_size: int = 49152
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """None for plain RoPE, else {"rope_type": "linear"|"dynamic"|"llama3"|"yarn", "factor": ..., ...}."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections (always on for qwen2; on llama/qwen3 it also puts a bias on o_proj, as HF does)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (qwen3)."""
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.architecture not in _HF_NAME:
            raise ModelConfigError(
                f"architecture={self.architecture!r} is not supported: use one of {sorted(_HF_NAME)}"
            )
        # Family-defined features: Qwen2 always has a q/k/v bias, only Qwen3 has q/k norm.
        if self.architecture == "qwen2":
            self.attention_bias = True
        self.qk_norm = self.architecture == "qwen3"
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ROPE_TYPES:
                raise ModelConfigError(
                    f"rope_scaling rope_type={rope_type!r} is not supported: use one of {list(ROPE_TYPES)}"
                )
            self.rope_scaling = {k: v for k, v in self.rope_scaling.items() if k not in ("type", "rope_theta")}
            self.rope_scaling["rope_type"] = rope_type
            if rope_type == "default":
                self.rope_scaling = None

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelArgs:
        """Read a Hugging Face config.json dict; raise ModelConfigError for what we cannot run."""
        archs = d.get("architectures") or []
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not archs and d.get("model_type") in _HF_NAME:  # configs saved without `architectures`
            known = [_HF_NAME[d["model_type"]]]
        if not known:
            raise ModelConfigError(
                f"unsupported architectures={archs!r} in config.json: supported are "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = SUPPORTED_ARCHITECTURES[known[0]]
        if d.get("use_sliding_window"):
            raise ModelConfigError("use_sliding_window=true is not supported: set it to false in config.json")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={d['hidden_act']!r} is not supported: only silu (SwiGLU)")
        if d.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported (no Llama/Qwen checkpoint uses it)")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelConfigError(f"partial_rotary_factor={d['partial_rotary_factor']} is not supported: only 1.0")

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if any(isinstance(v, dict) for v in rope.values()):
            raise ModelConfigError("per-layer-type rope_parameters are not supported")
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None

        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json dict transformers needs to build the same model."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        d: dict[str, Any] = {
            "architectures": [_HF_NAME[self.architecture]],
            "model_type": _MODEL_TYPE[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids))
            if self.eos_token_ids
            else None,
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(rope_parameters)
        if self.architecture == "qwen2":
            d["use_sliding_window"] = False
        else:
            d["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            d["mlp_bias"] = False
        return d

    def replace(self, **changes) -> ModelArgs:
        return dataclasses.replace(self, **changes)
