"""The model a plan is made for, on the meta device (shapes and dtypes, no memory).

    args = model_args("Qwen/Qwen2.5-7B-Instruct")   # a folder, an alias, or a bundled architecture
    lm = meta_model(args, torch.bfloat16)           # our CausalLM, built as the runtime builds it

A folder's config.json wins. Without the folder (planning before the download), the last path
component is looked up among the bundled architectures in ``plan/architectures/`` (config.json
fields only, with their source), so ``python -m staleflow plan --preset gpu-7b`` works offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from staleflow.config import ConfigError

BUNDLED = Path(__file__).parent / "architectures"


def bundled_architectures() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.json"))


def model_config(path: str) -> dict:
    """config.json of ``path``: a model folder, an alias (built on first use), a Hub id in the local
    Hugging Face cache, or a bundled name (a Hub id not downloaded yet can still be planned)."""
    from staleflow.model.aliases import ALIASES, AliasError, hub_snapshot, is_hub_id

    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text())
    if is_hub_id(path):
        try:
            return json.loads((hub_snapshot(path) / "config.json").read_text())
        except AliasError:
            pass  # not downloaded: its bundled architecture below
    elif path in ALIASES:
        from staleflow.model.loader import resolve_model_path

        return json.loads((Path(resolve_model_path(path)) / "config.json").read_text())
    bundled = BUNDLED / f"{Path(path).name.lower()}.json"
    if bundled.is_file():
        return json.loads(bundled.read_text())
    raise ConfigError(
        f"--model.path={path!r}: no config.json there and no bundled architecture of that name "
        f"({', '.join(bundled_architectures())}); give the model folder"
    )


def model_args(path: str):
    from staleflow.model.args import ModelArgs, ModelConfigError

    try:
        return ModelArgs.from_hf_config(model_config(path))
    except (ModelConfigError, KeyError) as e:
        raise ConfigError(f"--model.path={path!r}: cannot plan this model: {e}") from None


def meta_model(args, dtype: torch.dtype):
    """Our CausalLM on the meta device in ``dtype``: the same modules, names and shapes as a run's."""
    from staleflow.model.meta import on_meta
    from staleflow.model.transformer import CausalLM

    with on_meta():
        return CausalLM(args).to(dtype)


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one fused matrix count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())
