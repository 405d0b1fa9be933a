"""The trained policy as a Hugging Face safetensors folder.

export_hf(trainer, "runs/x/hf", tokenizer_from=resolve_model_path("smollm2-135m"))
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def export_hf(trainer, folder: str | Path, tokenizer_from: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the current policy as a HF safetensors folder (collective; rank 0 writes).

    Parameters are gathered one at a time and kept (cast to ``dtype``, on the CPU) by rank 0
    only: no other rank ever holds the full fp32 model (30 GB for a 7B)."""
    from staleflow.model.hf import save_hf

    sd = trainer.full_state_dict(rank0_only=True, dtype=dtype)
    if trainer.rank == 0:
        save_hf(trainer.model, folder, tokenizer_from=tokenizer_from, state_dict=sd)
    if trainer.sharded:
        dist.barrier(group=trainer.group)
    return Path(folder)
