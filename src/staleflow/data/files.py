"""Reading prompt/answer rows from .jsonl and .parquet files, with every bad row reported.

    rows, bad = read_rows(path, cfg)      # rows: [FileRow]; bad: [BadRow] (location, kind, reason)

A row is bad when its JSON line is invalid or not an object, the prompt or answer field is
missing, the prompt is not a string (answers may be strings or numbers), or the prompt or
answer is empty. Prompts over the token limit are checked later, after tokenisation (source.py).
Row numbers are 1-based: the line number in a .jsonl file, the row index + 1 in a .parquet file.
Whitespace-only lines in a .jsonl file are not rows (counted as blank lines).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from staleflow.config import DataConfig

SUFFIXES = (".jsonl", ".parquet")


class DataError(ValueError):
    """Bad data: a missing or unreadable file, a bad row (with bad_rows=error), no valid rows."""


@dataclass(frozen=True)
class FileRow:
    location: str
    """'file:row' (1-based) where the row came from."""
    text: str
    answer: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BadRow:
    location: str
    kind: str
    """invalid_json, not_object, missing_field, not_string, empty, too_long."""
    reason: str


def _parquet_records(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {str(path)!r} needs pyarrow, which is not installed: pip install pyarrow") from None
    try:
        return pq.read_table(str(path)).to_pylist()
    except Exception as e:
        raise DataError(f"cannot read parquet file {str(path)!r}: {e}") from None


def _records(path: Path) -> tuple[list[tuple[int, object, str | None]], int]:
    """[(row number, record or None, JSON error or None)], number of blank lines."""
    if path.suffix == ".parquet":
        return [(i + 1, rec, None) for i, rec in enumerate(_parquet_records(path))], 0
    out, blank = [], 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                blank += 1
                continue
            try:
                out.append((lineno, json.loads(line), None))
            except json.JSONDecodeError as e:
                out.append((lineno, None, f"invalid JSON ({e.msg} at column {e.colno})"))
    return out, blank


def _check_record(rec, cfg: DataConfig) -> tuple[str, str] | None:
    """(kind, reason) if the record is bad, else None."""
    if not isinstance(rec, dict):
        return "not_object", f"a row must be a JSON object, got {type(rec).__name__}"
    for name in (cfg.prompt_field, cfg.answer_field):
        if name not in rec:
            return "missing_field", f"missing field {name!r} (set --data.prompt-field / --data.answer-field)"
    prompt, answer = rec[cfg.prompt_field], rec[cfg.answer_field]
    if not isinstance(prompt, str):
        return "not_string", f"field {cfg.prompt_field!r} must be a string, got {type(prompt).__name__}"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return "not_string", f"field {cfg.answer_field!r} must be a string or a number, got {type(answer).__name__}"
    if not prompt.strip():
        return "empty", f"field {cfg.prompt_field!r} is empty"
    if not str(answer).strip():
        return "empty", f"field {cfg.answer_field!r} is empty"
    return None


def resolve_file(source: str) -> Path:
    """The data file named by --data.source; DataError if it is missing or of an unknown type."""
    path = Path(source).expanduser()
    if path.suffix not in SUFFIXES:
        raise DataError(
            f"--data.source={source!r} is not a built-in task (arithmetic, countdown) nor a .jsonl / .parquet file"
        )
    if not path.is_file():
        raise DataError(f"--data.source={source!r}: no such file; give an existing .jsonl or .parquet file")
    return path


def read_rows(path: Path, cfg: DataConfig) -> tuple[list[FileRow], list[BadRow], int]:
    """Good rows, bad rows and blank-line count of a data file. Fields other than prompt and
    answer go into meta (e.g. countdown's numbers and target)."""
    records, blank = _records(path)
    good: list[FileRow] = []
    bad: list[BadRow] = []
    for rowno, rec, json_error in records:
        location = f"{path}:{rowno}"
        problem = ("invalid_json", json_error) if json_error else _check_record(rec, cfg)
        if problem:
            bad.append(BadRow(location, *problem))
            continue
        meta = {k: v for k, v in rec.items() if k not in (cfg.prompt_field, cfg.answer_field)}
        meta["source_row"] = location
        good.append(FileRow(location, rec[cfg.prompt_field], str(rec[cfg.answer_field]), meta))
    return good, bad, blank
