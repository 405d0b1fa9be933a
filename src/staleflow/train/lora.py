"""LoRA on our CausalLM: low-rank adapters on chosen projections, the only parameters trained.

    names = apply_lora(model, cfg.lora)      # in place, before sharding; base weights frozen
    for name, t in lora_init(model, seed): ...   # A ~ PEFT's default init, B = 0: starts at the base model
    merged = merged_weight(module, a_full)   # W + (alpha / r) B A: what rollout engines get
    save_peft_adapter(model, cfg.lora, state, "runs/x/hf-lora", base="/models/Qwen3-8B")

A target projection (an ``nn.Linear`` named in ``--lora.target-modules``, in every layer) becomes a
``LoraLinear``: the same module with the same ``weight`` / ``bias`` (their Hugging Face names do
not change, and they are frozen) plus ``lora_A`` [r, in] and ``lora_B`` [out, r] (``nn.Linear``s,
so their names are PEFT's: ``...q_proj.lora_A.weight``):

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

Why merged weights for the rollout engine: the built-in engine then runs the plain model (no
extra GEMMs per step), and only the target projections' merged weights change from one version to
the next, so the Parameter Server carries only those (train/trainer.py ``pushed``); everything else
stays what the rollout rank loaded from --model.path. A mixture-of-experts layer's experts are not
adapted (they are not ``nn.Linear``s; transformers >= 5 stacks them, so PEFT could not load such
an adapter either).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

LORA_KEYS = (".lora_A.weight", ".lora_B.weight")


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update; made from an existing one by ``apply_lora``."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float
    dropout_p: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x, self.dropout_p, self.training) if self.dropout_p else x
        return F.linear(x, self.weight, self.bias) + self.scaling * self.lora_B(self.lora_A(h))


def lora_targets(model: nn.Module, targets) -> list[str]:
    """Names of the modules ``apply_lora`` adapts: every ``nn.Linear`` whose last name is a target."""
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and n.rsplit(".", 1)[-1] in set(targets)]


def lora_shapes(model: nn.Module, cfg) -> list[tuple[int, ...]]:
    """The shapes of the adapters ``apply_lora`` would add to ``model`` (A [r, in], B [out, r] per
    target), without changing it: what the memory plan counts."""
    out = []
    for name in lora_targets(model, cfg.targets):
        m = model.get_submodule(name)
        out += [(cfg.rank, m.in_features), (m.out_features, cfg.rank)]
    return out


def apply_lora(model: nn.Module, cfg) -> list[str]:
    """Turn the target projections of ``model`` into LoraLinears in place (on the weights' device and
    dtype, the meta device included) and freeze every other parameter; returns the adapted names."""
    names = lora_targets(model, cfg.targets)
    if not names:
        raise ValueError(
            f"--lora.target-modules {cfg.target_modules} names no projection of this model: use its "
            f"layer names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)"
        )
    model.requires_grad_(False)
    for name in names:
        m = model.get_submodule(name)
        w = m.weight
        m.__class__ = LoraLinear
        m.lora_A = nn.Linear(m.in_features, cfg.rank, bias=False, device=w.device, dtype=w.dtype)
        m.lora_B = nn.Linear(cfg.rank, m.out_features, bias=False, device=w.device, dtype=w.dtype)
        m.scaling, m.dropout_p = cfg.scaling, cfg.dropout
    model.lora_modules = names
    return names


def is_lora_param(name: str) -> bool:
    return name.endswith(LORA_KEYS)


def lora_init(model: nn.Module, seed: int = 0):
    """(name, full tensor) for every adapter parameter: A as PEFT initialises it (kaiming-uniform
    with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), B zero, so a fresh adapter changes nothing.
    Deterministic in ``seed``: every trainer rank draws the same full tensors and keeps its rows."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".lora_A.weight"):
            bound = 1.0 / math.sqrt(p.shape[1])
            yield name, torch.rand(tuple(p.shape), generator=gen, dtype=torch.float32) * (2 * bound) - bound
        elif name.endswith(".lora_B.weight"):
            yield name, torch.zeros(tuple(p.shape))


def merged_weight(module: LoraLinear, weight: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """W + scaling * B A for rows of W and B (``weight`` [n, in], ``b`` [n, r]) and the full A [r, in],
    in fp32 (the master dtype), detached."""
    return (weight.float() + module.scaling * (b.float() @ a.float())).detach()


def lora_shards(model: nn.Module, rank: int, world: int):
    """(name, merged local rows, row offset, full shape) of every adapted projection's weight, this
    rank's rows (FSDP2 shards W [out, in] and B [out, r] by the same rows); A is gathered whole
    (r x in: small), in the same order on every rank."""
    for name in model.lora_modules:
        m = model.get_submodule(name)
        w, b, a = m.weight, m.lora_B.weight, m.lora_A.weight
        a_full = a.full_tensor() if hasattr(a, "full_tensor") else a
        w_local = w.to_local() if hasattr(w, "to_local") else w
        b_local = b.to_local() if hasattr(b, "to_local") else b
        n = w.shape[0]
        c = -(-n // world)
        offset = min(rank * c, n) if hasattr(w, "to_local") else 0
        yield f"{name}.weight", merged_weight(m, w_local, b_local, a_full), offset, tuple(w.shape)


def merge_state_dict(model: nn.Module, state: dict[str, torch.Tensor], dtype=None) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict with every adapter merged into its projection and dropped:
    the Hugging Face state of the policy the rollout engines run. ``dtype`` casts after merging."""
    out = {k: v for k, v in state.items() if not is_lora_param(k)}
    for name in model.lora_modules:
        m = model.get_submodule(name)
        a, b = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
        out[f"{name}.weight"] = merged_weight(m, state[f"{name}.weight"], b, a)
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in out.items()}


def adapter_state(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a full state dict, under PEFT's names (``base_model.model.`` + ours)."""
    return {f"base_model.model.{k}": v for k, v in full.items() if is_lora_param(k)}


def save_peft_adapter(cfg, state: dict[str, torch.Tensor], folder: str | Path, base: str = "") -> Path:
    """A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) that
    ``peft.PeftModel.from_pretrained(base_model, folder)`` loads; ``state`` from ``adapter_state``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    tmp = folder / ".adapter_model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def adapter_bytes(model: nn.Module) -> int:
    """Bytes of the adapter parameters in the master dtype (a checkpoint holds these and AdamW's two
    moments of each: three times as much)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_lora_param(n))
