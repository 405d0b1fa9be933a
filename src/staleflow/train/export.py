"""The trained policy as a Hugging Face safetensors folder (and, for a LoRA run, its PEFT adapter).

export_hf(trainer, "runs/x/hf", tokenizer_from=resolve_model_path("smollm2-135m"))
    # LoRA: runs/x/hf holds the merged policy, runs/x/hf-lora the adapter PEFT loads
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def adapter_folder(folder: str | Path) -> Path:
    """Where a LoRA run's PEFT adapter goes: next to the merged folder, ``<folder>-lora``."""
    folder = Path(folder)
    return folder.with_name(folder.name + "-lora")


def export_hf(trainer, folder: str | Path, tokenizer_from: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the current policy as a HF safetensors folder (collective; rank 0 writes).

    Parameters are gathered one at a time and kept (cast to ``dtype``, on the CPU) by rank 0
    only: no other rank ever holds the full fp32 model (30 GB for a 7B). A LoRA policy is written
    merged (W + (alpha / r) B A, in fp32 before the cast: a plain model transformers loads as it
    is), and its adapters as a PEFT folder next to it (``adapter_folder``) for the base model."""
    from staleflow.model.hf import save_hf

    lora = getattr(trainer, "lora", None)
    sd = trainer.full_state_dict(rank0_only=True, dtype=None if lora is not None else dtype)
    if trainer.rank == 0:
        if lora is not None:
            from staleflow.train.lora import adapter_state, merge_state_dict, save_peft_adapter

            save_peft_adapter(lora, adapter_state(trainer.model, sd), adapter_folder(folder), base=tokenizer_from or "")
            sd = merge_state_dict(trainer.model, sd, dtype)
        save_hf(trainer.model, folder, tokenizer_from=tokenizer_from, state_dict=sd)
    if trainer.sharded:
        dist.barrier(group=trainer.group)
    return Path(folder)
