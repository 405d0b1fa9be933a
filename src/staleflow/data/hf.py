"""Data sources read with the Hugging Face ``datasets`` library, offline.

    kind, target = resolve_source("train.parquet", cfg)      # ("parquet", Path)
    records = dataset_records(kind, target, cfg, limit=8)    # [dict], the first 8 rows

Kinds: ``jsonl`` (read line by line in files.py, for per-line bad-row reports), ``parquet`` and
``json`` files, ``disk`` (a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``)
and ``hub`` (a dataset name, e.g. ``openai/gsm8k``, resolved offline from datasets' own cache or
from the hub cache's snapshot that ``huggingface-cli download --repo-type dataset NAME`` wrote:
a run never downloads). ``--data.split`` picks the split (default train) and
``--data.subset`` the configuration of a hub dataset. Nothing read here runs code: no dataset
loading scripts (``trust_remote_code`` is never passed), parquet and arrow are data only, and no
feature is decoded (an ``Image`` column's path is never opened). Files and save_to_disk folders are
read by data/arrow.py (bounded rows, confined names, regular files only), not by ``datasets``.
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
        from staleflow.inputs import special_file

        problem = special_file(path)
        if problem == "does not exist":
            raise DataError(f"--data.source={source!r}: no such file; give an existing .jsonl, .parquet or .json file")
        if problem:  # a FIFO or a device: never opened
            raise DataError(f"--data.source={source!r} {problem}; give a .jsonl, .parquet or .json file")
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


def dataset_records(kind: str, target, cfg: DataConfig, limit: int | None = None):
    """[(row number, record or None, (kind, reason) or None)] of a parquet / json file, a save_to_disk
    folder or a cached hub dataset (at most ``limit`` rows); None for a .json file of JSON lines (the
    caller reads those line by line). Files and folders are read by data/arrow.py: bounded rows,
    features never decoded, names confined to their folder."""
    from staleflow.data.arrow import disk_records, json_records, parquet_records, table_records

    if kind in ("parquet", "disk"):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise DataError(
                f"reading {str(target)!r} needs pyarrow, which is not installed: pip install pyarrow"
            ) from None
    if kind == "parquet":
        return parquet_records(target, limit)
    if kind == "json":
        return json_records(target, limit)
    if kind == "disk":
        return disk_records(target, cfg.split, limit)
    datasets = _datasets()
    try:
        ds = _hub(datasets, str(target), cfg)
        table = ds.data.table if hasattr(ds.data, "table") else ds.data  # plain arrow: features never decoded
        return table_records(table.to_batches(max_chunksize=256), limit)
    except DataError:
        raise
    except Exception as e:  # a corrupt cache entry: one line naming it
        msg = " ".join(str(e).split())[:300]
        raise DataError(f"--data.source={str(target)!r} cannot be read ({type(e).__name__}: {msg})") from None


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
