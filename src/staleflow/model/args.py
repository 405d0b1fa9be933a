"""ModelArgs: the architecture description of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder.

Built from a Hugging Face `config.json` dict with `ModelArgs.from_hf_config(d)` and written
back with `.to_hf_config()`, so a folder we save loads in `transformers` unchanged. Both the
transformers-4 (`rope_theta` + `rope_scaling`) and transformers-5 (`rope_parameters`) spellings
of RoPE settings are read; both are written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_HF_NAME = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


MAX_LAYERS = 1024
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 27
ROPE_FLOATS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow")
ROPE_FLOATS += ("mscale", "mscale_all_dim")
"""Ranges far beyond any Llama/Qwen checkpoint: a config.json outside them is crafted or broken, and
refusing it in one line beats building a meta model of a million layers or a 1e300 RoPE factor."""


class ModelConfigError(ValueError):
    """A config.json this implementation cannot run (unsupported architecture or feature, or a field
    of the wrong type or outside its range: the message names the field)."""


def _show(value) -> str:
    return repr(value)[:40]


def _integer(d: dict, key: str, lo: int, hi: int, default: int | None = None, prefix: str = "") -> int:
    value = d.get(key)
    if value is None and default is not None:
        return default
    if type(value) is not int or not lo <= value <= hi:
        raise ModelConfigError(f"field {prefix}{key} is {_show(value)}, not an integer in [{lo}, {hi}]")
    return value


def _number(d: dict, key: str, lo: float, hi: float, default: float | None = None, prefix: str = "") -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ModelConfigError(f"field {prefix}{key} is {_show(value)}, not a number in [{lo:g}, {hi:g}]")
    return float(value)


@dataclass
class ModelArgs:
    """Architecture hyper-parameters (names follow the paper-free HF meaning, not HF spelling)."""

    architecture: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = "llama"
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
    # Mixture of experts (qwen3_moe; model/moe.py). A layer is sparse when it is not in
    # mlp_only_layers and (layer + 1) % decoder_sparse_step == 0, as transformers decides.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    """top-k: experts each token is routed to."""
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 (transformers' default is False)."""
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    """Carried through config.json unchanged; the trainer's own weight is --train.router-aux-coef."""

    def __post_init__(self):
        if self.architecture not in _HF_NAME:
            raise ModelConfigError(
                f"architecture={self.architecture!r} is not supported: use one of {sorted(_HF_NAME)}"
            )
        # Family-defined features: Qwen2 always has a q/k/v bias, only Qwen3 has q/k norm.
        if self.architecture == "qwen2":
            self.attention_bias = True
        self.qk_norm = self.architecture in ("qwen3", "qwen3_moe")
        check_moe_args(self)
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

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has a sparse expert block (else a dense SwiGLU MLP)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelArgs:
        """Read a Hugging Face config.json dict; raise ModelConfigError for what we cannot run."""
        if not isinstance(d, dict):
            raise ModelConfigError(f"it is a JSON {type(d).__name__}, not an object")
        if "auto_map" in d:
            raise ModelConfigError(
                "field auto_map names custom model code, which staleflow never runs: use a Llama/Qwen2/Qwen3 "
                "folder without auto_map"
            )
        archs = d.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ModelConfigError(f"field architectures is {_show(archs)}, not a list of names")
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if (
            not archs and isinstance(d.get("model_type"), str) and d.get("model_type") in _HF_NAME
        ):  # configs saved without `architectures`
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
            raise ModelConfigError(f"hidden_act={_show(d['hidden_act'])} is not supported: only silu (SwiGLU)")
        if d.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported (no Llama/Qwen checkpoint uses it)")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelConfigError(
                f"partial_rotary_factor={_show(d['partial_rotary_factor'])} is not supported: only 1.0"
            )

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelConfigError(f"field rope_parameters/rope_scaling is a {type(rope).__name__}, not an object")
        if any(isinstance(v, dict) for v in rope.values()):
            raise ModelConfigError("per-layer-type rope_parameters are not supported")
        if "rope_theta" in rope:
            rope_theta = _number(rope, "rope_theta", 1.0, 1e12, None, "rope_parameters.")
        else:
            rope_theta = _number(d, "rope_theta", 1.0, 1e12, 10000.0)
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"rope_scaling rope_type={_show(rope_type)} is not supported: use one of {list(ROPE_TYPES)}"
            )
        needed = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ROPE_FLOATS[:3]}.get(rope_type, ())
        for key in needed:
            if rope.get(key) is None:
                raise ModelConfigError(f"field rope_parameters.{key} is missing (rope_type {rope_type} needs it)")
        for key, value in (rope_scaling or {}).items():
            if key in ("rope_type", "type"):
                continue
            elif key == "original_max_position_embeddings":
                _integer(rope, key, 1, MAX_POSITIONS, None, "rope_parameters.")
            elif key in ROPE_FLOATS:
                if value is not None:
                    _number(rope, key, 1e-6, 1e4, None, "rope_parameters.")
            elif not isinstance(value, (str, bool)) and value is not None:
                raise ModelConfigError(f"field rope_parameters.{key} is {_show(value)}: not a known RoPE setting")

        num_heads = _integer(d, "num_attention_heads", 1, 4096)
        hidden = _integer(d, "hidden_size", 1, 1 << 17)
        vocab = _integer(d, "vocab_size", 1, MAX_VOCAB)
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if not isinstance(eos, list) else eos)
        if len(eos_list) > 64 or not all(type(e) is int and 0 <= e < vocab for e in eos_list):
            raise ModelConfigError(f"field eos_token_id is {_show(eos)}: token ids in [0, vocab_size={vocab})")
        bos = d.get("bos_token_id")
        if bos is not None and not (type(bos) is int and 0 <= bos < vocab):
            raise ModelConfigError(f"field bos_token_id is {_show(bos)}: a token id in [0, vocab_size={vocab})")
        head_dim = d.get("head_dim")
        for key in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(d.get(key, False), bool):
                raise ModelConfigError(f"field {key} is {_show(d.get(key))}, not true/false")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_integer(d, "intermediate_size", 1, 1 << 20),
            num_layers=_integer(d, "num_hidden_layers", 1, MAX_LAYERS),
            num_heads=num_heads,
            num_kv_heads=_integer(d, "num_key_value_heads", 1, 4096, num_heads),
            head_dim=_integer(d, "head_dim", 2, 4096, hidden // num_heads if head_dim is None else None),
            rms_norm_eps=_number(d, "rms_norm_eps", 1e-12, 0.5, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_integer(d, "max_position_embeddings", 1, MAX_POSITIONS, 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=True if arch == "qwen2" else d.get("attention_bias", False),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            bos_token_id=bos,
            eos_token_ids=list(eos_list),
            **(moe_fields_from_hf(d) if arch == "qwen3_moe" else {}),
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
        if self.architecture == "qwen3_moe":
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                output_router_logits=False,
                use_sliding_window=False,
                sliding_window=None,
            )
        return d

    def replace(self, **changes) -> ModelArgs:
        return dataclasses.replace(self, **changes)


def check_moe_args(args: ModelArgs) -> None:
    """The expert fields are consistent (one ModelConfigError naming the field otherwise)."""
    if args.architecture != "qwen3_moe":
        if args.num_experts:
            raise ModelConfigError(
                f"num_experts={args.num_experts} needs architecture qwen3_moe, not {args.architecture}"
            )
        return
    if args.num_experts <= 0:
        return  # every layer dense, as transformers builds it
    if not 1 <= args.num_experts_per_tok <= args.num_experts:
        raise ModelConfigError(
            f"field num_experts_per_tok is {args.num_experts_per_tok}: need 1 <= it <= num_experts={args.num_experts}"
        )
    if args.moe_intermediate_size <= 0:
        raise ModelConfigError(f"field moe_intermediate_size is {args.moe_intermediate_size}: must be > 0")
    if args.decoder_sparse_step < 1:
        raise ModelConfigError(f"field decoder_sparse_step is {args.decoder_sparse_step}: must be >= 1")
    bad = [i for i in args.mlp_only_layers if type(i) is not int or not 0 <= i < args.num_layers]
    if bad:
        raise ModelConfigError(f"field mlp_only_layers holds {_show(bad)}: layer indices in [0, {args.num_layers})")


def moe_fields_from_hf(d: dict) -> dict:
    """The expert fields of a Qwen3-MoE config.json, typed and range-checked. ``num_experts`` is the
    Hub's spelling, ``num_local_experts`` transformers 5's; there are no shared experts in Qwen3-MoE
    (Qwen2-MoE's ``shared_expert_intermediate_size`` is refused)."""
    if d.get("shared_expert_intermediate_size"):
        raise ModelConfigError("field shared_expert_intermediate_size: shared experts (Qwen2-MoE) are not supported")
    key = "num_experts" if "num_experts" in d else "num_local_experts"
    experts = _integer(d, key, 0, 4096, 0)
    layers = d.get("mlp_only_layers") or []
    if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
        raise ModelConfigError(f"field mlp_only_layers is {_show(layers)}, not a list of layer indices")
    for key_b in ("norm_topk_prob",):
        if not isinstance(d.get(key_b, False), bool):
            raise ModelConfigError(f"field {key_b} is {_show(d.get(key_b))}, not true/false")
    return dict(
        num_experts=experts,
        num_experts_per_tok=_integer(d, "num_experts_per_tok", 1, 4096, 1) if experts else 0,
        moe_intermediate_size=_integer(d, "moe_intermediate_size", 1, 1 << 20) if experts else 0,
        norm_topk_prob=d.get("norm_topk_prob", False),
        decoder_sparse_step=_integer(d, "decoder_sparse_step", 1, MAX_LAYERS, 1),
        mlp_only_layers=list(layers),
        router_aux_loss_coef=_number(d, "router_aux_loss_coef", 0.0, 1e3, 0.001),
    )
