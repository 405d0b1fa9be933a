"""Bounded readers of columnar data sources: parquet files, ``save_to_disk`` folders, JSON arrays.

    records = parquet_records(path, limit)        # [(row number, record or None, (kind, reason) or None)]
    records = disk_records(folder, split, limit)  # a save_to_disk folder (Dataset or DatasetDict)
    records = json_records(path, limit)           # a .json file: a JSON array, or JSON lines
    records = table_records(batches, limit)       # any pyarrow record batches (a hub dataset's table)

What a parquet or arrow file may not do here:
- decode features: columns are read as plain arrow data (``to_pylist``); a Hugging Face ``Image``,
  ``Audio`` or ``Video`` feature declared in the file's metadata is never decoded, so no path it names
  (``/etc/hostname``, a FIFO) is ever opened;
- blow up: a row over MAX_ROW_BYTES (16 MiB, as a .jsonl line) is a bad row, ``too_large``, found from
  the parquet metadata before any data is read where it can be (a row group of one row) and from the
  row's arrow size otherwise, before it becomes Python objects; a column chunk declaring more than
  MAX_CHUNK_BYTES is refused unread (an 8.9 KB zstd file holding one 256 MB prompt was accepted, at
  932 MB RSS, with 256 MB written to the datasets cache: nothing is written now);
- leave its folder: a save_to_disk folder's ``state.json`` (and ``dataset_dict.json``) are typed and
  their file names plain names inside the folder (no ``../``, no absolute path), every file a regular
  file (a FIFO is refused before it is opened).
"""

from __future__ import annotations

import os
from pathlib import Path

from staleflow.data.errors import MAX_ROW_BYTES, DataError
from staleflow.inputs import InputError, load_json, open_regular, read_capped

MAX_CHUNK_BYTES = 1 << 30
"""A parquet column chunk declaring more than this uncompressed is refused (rewrite smaller row groups)."""
_BATCH_ROWS = 256
Records = list[tuple[int, object, tuple[str, str] | None]]


def _too_large(n: int) -> tuple[str, str]:
    return "too_large", f"a row of {n} bytes > {MAX_ROW_BYTES}"


def table_records(batches, limit: int | None = None, start: int = 1, skip: dict[int, int] | None = None) -> Records:
    """Records of pyarrow record batches, each row checked for size before it becomes Python objects.
    ``skip``: rows already known to be too large (row number -> declared bytes), never decoded."""
    out: Records = []
    rowno = start
    for batch in batches:
        sizes = [batch.slice(i, 1).nbytes for i in range(batch.num_rows)]
        if max(sizes, default=0) <= MAX_ROW_BYTES and not skip:
            rows = batch.to_pylist()
        else:
            rows = [None if n > MAX_ROW_BYTES else batch.slice(i, 1).to_pylist()[0] for i, n in enumerate(sizes)]
        for n, rec in zip(sizes, rows):
            if limit is not None and len(out) >= limit:
                return out
            out.append((rowno, None, _too_large(n)) if rec is None else (rowno, rec, None))
            rowno += 1
    return out


def parquet_records(path: Path, limit: int | None = None) -> Records:
    """The records of a parquet file (module docstring); DataError (one line) for one that cannot be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fd = _open(path)
    try:
        pf = pq.ParquetFile(os.fdopen(fd, "rb", closefd=False))
        meta = pf.metadata
        out: Records = []
        rowno = 1
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            declared = [group.column(c).total_uncompressed_size for c in range(group.num_columns)]
            if max(declared, default=0) > MAX_CHUNK_BYTES:
                raise DataError(
                    f"--data.source={str(path)!r}: row group {g} declares {max(declared)} bytes in one column "
                    f"(> {MAX_CHUNK_BYTES}): rewrite the file with smaller row groups"
                )
            if limit is not None and len(out) >= limit:
                break
            if group.num_rows == 1 and sum(declared) > MAX_ROW_BYTES:  # one row, too large: never decoded
                out.append((rowno, None, _too_large(sum(declared))))
            else:
                batches = pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=[g], use_threads=False)
                out += table_records(batches, None if limit is None else limit - len(out), rowno)
            rowno += group.num_rows
        return out
    except DataError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"--data.source={str(path)!r} cannot be read ({type(e).__name__}: {_line(e)})") from None
    finally:
        os.close(fd)


def _open(path: Path) -> int:
    try:
        return open_regular(path)
    except InputError as e:
        raise DataError(f"--data.source: {e}") from None


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _json_file(path: Path, what: str):
    try:
        return load_json(path)
    except InputError as e:
        raise DataError(f"--data.source: {what} {e}") from None


def _name_in(folder: Path, name, what: str) -> Path:
    """``folder / name`` for a plain file name; DataError for a path, '..', or anything but a string."""
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise DataError(
            f"--data.source={str(folder)!r}: {what} names {str(name)[:120]!r}, not a file name inside the "
            f"folder (no path, no '..'); re-save the dataset with save_to_disk"
        )
    return folder / name


def disk_records(folder: Path, split: str, limit: int | None = None) -> Records:
    """The records of a save_to_disk folder (a Dataset, or a DatasetDict's ``split``), read as arrow
    streams with every name typed and confined to its folder (module docstring)."""
    import pyarrow as pa

    if (folder / "dataset_dict.json").exists():
        info = _json_file(folder / "dataset_dict.json", "a save_to_disk folder's")
        splits = info.get("splits") if isinstance(info, dict) else None
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(f"--data.source={str(folder)!r}: dataset_dict.json has no list of split names")
        if split not in splits:
            raise DataError(
                f"--data.source={str(folder)!r} has splits {sorted(splits)}, not --data.split={split!r}: pick one of them"
            )
        folder = _name_in(folder, split, "dataset_dict.json")
    state = _json_file(folder / "state.json", "a save_to_disk folder's")
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise DataError(f"--data.source={str(folder)!r}: state.json has no list of _data_files")
    out: Records = []
    for entry in files:
        path = _name_in(folder, entry.get("filename"), "state.json")
        fd = _open(path)
        try:
            with pa.ipc.open_stream(pa.PythonFile(os.fdopen(fd, "rb", closefd=False), mode="r")) as reader:
                out += table_records(reader, None if limit is None else limit - len(out), len(out) + 1)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(f"--data.source={str(path)!r} cannot be read ({type(e).__name__}: {_line(e)})") from None
        finally:
            os.close(fd)
        if limit is not None and len(out) >= limit:
            break
    return out


def json_records(path: Path, limit: int | None = None, max_bytes: int = 1 << 31) -> Records | None:
    """A .json file holding a JSON array: each element one row, sized from its own text. None when the
    file is JSON lines instead (files.py reads those line by line)."""
    import json

    try:
        data = read_capped(path, max_bytes)
    except InputError as e:
        raise DataError(f"--data.source: {e}") from None
    text = data.decode("utf-8", errors="surrogateescape")
    body = text.lstrip()
    if not body.startswith("["):
        return None
    decoder, out = json.JSONDecoder(), []
    pos, rowno = len(text) - len(body) + 1, 1
    while limit is None or len(out) < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            rec, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            out.append((rowno, None, ("invalid_json", f"invalid JSON ({e.msg} at character {e.pos})")))
            break  # the rest of the array cannot be told apart
        except RecursionError:
            out.append((rowno, None, ("invalid_json", "invalid JSON (nested too deeply)")))
            break
        out.append((rowno, None, _too_large(end - pos)) if end - pos > MAX_ROW_BYTES else (rowno, rec, None))
        pos, rowno = end, rowno + 1
    return out
