"""Data sources read with the Hugging Face ``datasets`` library, offline.

    kind, target = resolve_source("train.parquet", cfg)      # ("parquet", Path)
    records = dataset_records(kind, target, cfg, limit=8)    # [dict], the first 8 rows

Kinds: ``jsonl`` (read line by line in files.py, for per-line bad-row reports), ``parquet`` and
``json`` files, ``disk`` (a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``)
and ``hub`` (a dataset name, e.g. ``openai/gsm8k``, resolved offline from datasets' own cache or
from the hub cache's snapshot that ``huggingface-cli download --repo-type dataset NAME`` wrote:
a run never downloads). ``--data.split`` picks the split (default train) and
``--data.subset`` the configuration of a hub dataset. Nothing read here runs code: no dataset
loading scripts (``trust_remote_code`` is never passed), parquet and arrow are data only.
"""

from __future__ import annotations

import os
from pathlib import Path

from staleflow.config import DataConfig
from staleflow.data.errors import SUFFIXES, DataError


def resolve_source(source: str, cfg: DataConfig) -> tuple[str, Path | str]:
    """(kind, path or name) of one data source; DataError naming the fix when it cannot be read."""
    path = Path(source).expanduser()
    if path.suffix in SUFFIXES:
        if not path.is_file():
            raise DataError(f"--data.source={source!r}: no such file; give an existing .jsonl, .parquet or .json file")
        return path.suffix[1:], path
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return "disk", path
        raise DataError(
            f"--data.source={source!r} is a folder but not one written by datasets' save_to_disk "
            f"(no dataset_info.json or dataset_dict.json); give the folder save_to_disk wrote or a data file"
        )
    return "hub", source


def _datasets():
    """The datasets module, offline: the environment variables for a first import, the module
    constants for a process where transformers or datasets already read them (a run never waits
    on network time-outs nor downloads)."""
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        import huggingface_hub.constants
    except ImportError:
        raise DataError("reading this data source needs the datasets package: pip install datasets pyarrow") from None
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def _pick_split(ds, source: str, cfg: DataConfig):
    """A Dataset from a Dataset or DatasetDict, by --data.split."""
    if isinstance(ds, dict):  # a DatasetDict
        if cfg.split not in ds:
            raise DataError(
                f"--data.source={source!r} has splits {sorted(ds)}, not --data.split={cfg.split!r}: pick one of them"
            )
        return ds[cfg.split]
    return ds


def dataset_records(kind: str, target, cfg: DataConfig, limit: int | None = None) -> list:
    """The records (dicts) of a parquet / json file, a save_to_disk folder or a cached hub dataset."""
    if kind == "parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise DataError(
                f"reading {str(target)!r} needs pyarrow, which is not installed: pip install pyarrow"
            ) from None
    datasets = _datasets()
    source = str(target)
    try:
        if kind in ("parquet", "json"):
            ds = datasets.load_dataset(kind, data_files=source, split="train", keep_in_memory=True)
        elif kind == "disk":
            ds = _pick_split(datasets.load_from_disk(source, keep_in_memory=True), source, cfg)
        else:
            ds = _hub(datasets, source, cfg)
    except DataError:
        raise
    except Exception as e:  # a corrupt file, an unreadable folder: one line naming it
        msg = " ".join(str(e).split())[:300]
        raise DataError(f"--data.source={source!r} cannot be read ({type(e).__name__}: {msg})") from None
    n = len(ds) if limit is None else min(limit, len(ds))
    try:
        return list(ds.select(range(n))) if n < len(ds) else list(ds)
    except Exception as e:
        raise DataError(f"--data.source={source!r}: reading its rows failed ({type(e).__name__}: {e})") from None


def _hub(datasets, name: str, cfg: DataConfig):
    """A dataset name from the local caches: datasets' own (a load_dataset done with network), else
    the hub cache's snapshot (huggingface-cli download --repo-type dataset NAME), read as a folder."""
    from staleflow.data.tasks import TASKS

    fetch = (
        f"fetch it on a machine with network (huggingface-cli download --repo-type dataset {name}, or "
        f"datasets.load_dataset({name!r}).save_to_disk(DIR) and pass --data.source DIR)"
    )
    subset = cfg.subset or None
    try:
        return datasets.load_dataset(name, subset, split=cfg.split)
    except ValueError as e:
        if "split" in str(e).lower() or "config" in str(e).lower():
            raise DataError(
                f"--data.source={name!r}: {' '.join(str(e).split())[:200]}; set --data.split / --data.subset"
            ) from None
    except Exception:
        pass
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name, repo_type="dataset", local_files_only=True)
    except Exception:
        raise DataError(
            f"--data.source={name!r} is not a registered task ({', '.join(sorted(TASKS))}), a .jsonl / .parquet / "
            f".json file, a save_to_disk folder, nor a dataset in the local Hugging Face cache (offline): {fetch}"
        ) from None
    try:
        return datasets.load_dataset(folder, subset, split=cfg.split)
    except ValueError as e:
        raise DataError(
            f"--data.source={name!r}: {' '.join(str(e).split())[:200]}; set --data.split / --data.subset"
        ) from None
