"""Reading prompt/answer rows from a data source, with every bad row reported.

    rows, bad, blank = read_rows("train.parquet", cfg)   # rows: [FileRow]; bad: [BadRow]
    rows, bad, blank = read_rows(spec, cfg, limit=8)     # the first 8 records (staleflow check)

A source is a .jsonl file (read here line by line, so a bad line is one bad row), or anything the
Hugging Face ``datasets`` library reads (data/hf.py): a .parquet / .json file, a folder written by
``save_to_disk``, a dataset name in the local hub cache.

A row is bad when it is larger than 16 MiB (``too_large``: never decoded, whatever the format), its
JSON line is invalid (bad syntax, nested too deeply, invalid UTF-8) or not an object, the prompt or answer field is missing, the prompt is neither a string nor a list of chat
messages ({"role": str, "content": str}), the answer is not a string or number, or either is empty.
Fields may be dotted paths into nested records (``reward_model.ground_truth``). The answer field
``auto`` (the default) takes the first of ``answer``, ``reward_model.ground_truth`` (verl's layout),
``solution``, ``ground_truth`` that the row has. Prompts over the token limit are checked later,
after tokenisation (source.py). Row numbers are 1-based: the line number in a .jsonl file, the
record index + 1 elsewhere. Whitespace-only lines in a .jsonl file are not rows (blank lines).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from staleflow.config import DataConfig
from staleflow.data.errors import MAX_ROW_BYTES, SUFFIXES, DataError

__all__ = ["SUFFIXES", "BadRow", "DataError", "FileRow", "check_record", "read_rows"]

AUTO_ANSWER_FIELDS = ("answer", "reward_model.ground_truth", "solution", "ground_truth")
"""--data.answer-field auto: the first of these a row has (plain files, verl, TRL / HF math sets)."""
MAX_LINE_BYTES = MAX_ROW_BYTES
"""A .jsonl line longer than this (16 MiB) is a bad row, never parsed."""


@dataclass(frozen=True)
class FileRow:
    location: str
    """'source:row' (1-based) where the row came from."""
    text: str
    """The prompt as a string: the text itself, or the chat messages' contents (logging, reports)."""
    answer: str
    meta: dict = field(default_factory=dict)
    messages: tuple = ()
    """Chat prompt: ((role, content), ...); empty for a string prompt."""
    answer_field: str = ""
    """The field the answer was read from (--data.answer-field auto picks one per row)."""


@dataclass(frozen=True)
class BadRow:
    location: str
    kind: str
    """invalid_json, invalid_utf8, too_large, not_object, missing_field, not_string, empty, too_long, unscorable."""
    reason: str


def get_path(rec: dict, path: str):
    """rec['a']['b'] for 'a.b' (a key containing the dot itself wins); KeyError if absent."""
    if path in rec:
        return rec[path]
    cur = rec
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(path)
        cur = cur[part]
    return cur


def has_path(rec: dict, path: str) -> bool:
    try:
        get_path(rec, path)
    except KeyError:
        return False
    return True


def answer_field_of(rec: dict, cfg: DataConfig) -> str | None:
    """The answer field this row uses (auto: the first of AUTO_ANSWER_FIELDS it has)."""
    if cfg.answer_field != "auto":
        return cfg.answer_field if has_path(rec, cfg.answer_field) else None
    return next((f for f in AUTO_ANSWER_FIELDS if has_path(rec, f)), None)


def _messages(prompt) -> tuple[tuple[tuple[str, str], ...] | None, str]:
    """(((role, content), ...), '') for a valid chat-message list, else (None, why)."""
    if not prompt:
        return None, "is an empty message list"
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None, f"message {i} is not {{'role': str, 'content': str}}"
        out.append((m["role"], m["content"]))
    if not any(c.strip() for _, c in out):
        return None, "has only empty messages"
    return tuple(out), ""


def _is_unicode(*texts: str) -> bool:
    """Every text is encodable UTF-8 (JSON allows lone surrogate escapes; tokenizers do not)."""
    try:
        for t in texts:
            t.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _plain(v):
    """A meta value as JSON can hold it (checkpoints keep in-flight prompts): a parquet timestamp,
    bytes or a decimal becomes its text."""
    if v is None or isinstance(v, (str, bool, int, float)):
        return v
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def check_record(rec, cfg: DataConfig) -> tuple[str, str] | FileRow:
    """(kind, reason) if the record is bad, else FileRow (location and source meta filled by the caller)."""
    if not isinstance(rec, dict):
        return "not_object", f"a row must be a JSON object, got {type(rec).__name__}"
    try:
        return _check_object(rec, cfg)
    except RecursionError:  # a value nested as deep as the parser allows
        return "invalid_json", "a value nested too deeply"


def _check_object(rec: dict, cfg: DataConfig) -> tuple[str, str] | FileRow:
    if not has_path(rec, cfg.prompt_field):
        return "missing_field", f"missing field {cfg.prompt_field!r} (set --data.prompt-field)"
    afield = answer_field_of(rec, cfg)
    if afield is None:
        names = " / ".join(AUTO_ANSWER_FIELDS) if cfg.answer_field == "auto" else repr(cfg.answer_field)
        return "missing_field", f"missing field {names} (set --data.answer-field)"
    prompt, answer = get_path(rec, cfg.prompt_field), get_path(rec, afield)
    messages: tuple = ()
    if isinstance(prompt, list):
        msgs, why = _messages(prompt)
        if msgs is None:
            return "not_string", f"field {cfg.prompt_field!r} {why}"
        messages, text = msgs, "\n".join(c for _, c in msgs)
    elif isinstance(prompt, str):
        text = prompt
    else:
        return (
            "not_string",
            f"field {cfg.prompt_field!r} must be a string or a list of chat messages, got {type(prompt).__name__}",
        )
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return "not_string", f"field {afield!r} must be a string or a number, got {type(answer).__name__}"
    if not _is_unicode(text, *(r for r, _ in messages), str(answer)):  # a JSON '\\ud800' escape
        return "invalid_utf8", "a string holds an unpaired surrogate (an invalid \\uD800-\\uDFFF escape)"
    if not text.strip():
        return "empty", f"field {cfg.prompt_field!r} is empty"
    if not str(answer).strip():
        return "empty", f"field {afield!r} is empty"
    top = {cfg.prompt_field.split(".", 1)[0], afield} if afield in rec else {cfg.prompt_field}
    meta = {str(k): _plain(v) for k, v in rec.items() if k not in top}
    return FileRow("", text, str(answer), meta, messages, afield)


def _jsonl_records(path: Path, limit: int | None) -> tuple[list[tuple[int, object, tuple[str, str] | None]], int]:
    """[(line number, record, (kind, error) or None)], blank lines: each line decoded on its own."""
    from staleflow.inputs import InputError, open_regular

    out, blank = [], 0
    try:
        fd = open_regular(path)  # a FIFO or a device is refused before it is opened
    except InputError as e:
        raise DataError(f"--data.source: {e}") from None
    with open(fd, "rb") as fh:
        lineno = 0
        while raw := fh.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            if limit is not None and len(out) >= limit:
                break
            if len(raw) > MAX_LINE_BYTES:  # never held whole: the rest of the line is skipped in chunks
                while raw and not raw.endswith(b"\n"):
                    raw = fh.readline(MAX_LINE_BYTES)
                out.append((lineno, None, ("too_large", f"a line of more than {MAX_LINE_BYTES} bytes")))
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.append((lineno, None, ("invalid_utf8", f"invalid UTF-8 at byte {e.start}")))
                continue
            if not line.strip():
                blank += 1
                continue
            try:
                out.append((lineno, json.loads(line), None))
            except json.JSONDecodeError as e:
                out.append((lineno, None, ("invalid_json", f"invalid JSON ({e.msg} at column {e.colno})")))
            except RecursionError:
                out.append((lineno, None, ("invalid_json", "invalid JSON (nested too deeply)")))
    return out, blank


def is_file_source(source: str) -> bool:
    return Path(source).suffix in SUFFIXES


def read_rows(source: str, cfg: DataConfig, limit: int | None = None) -> tuple[list[FileRow], list[BadRow], int]:
    """Good rows, bad rows and blank-line count of one data source (at most `limit` records)."""
    from staleflow.data.hf import dataset_records, resolve_source

    kind, target = resolve_source(source, cfg)
    records = dataset_records(kind, target, cfg, limit) if kind != "jsonl" else None
    blank = 0
    if records is None:  # .jsonl, or a .json file of JSON lines: one bad line is one bad row
        records, blank = _jsonl_records(target, limit)
    good: list[FileRow] = []
    bad: list[BadRow] = []
    for rowno, rec, error in records:
        location = f"{source}:{rowno}"
        got = error if error else check_record(rec, cfg)
        if isinstance(got, tuple):
            bad.append(BadRow(location, *got))
            continue
        meta = {**got.meta, "source_row": location}
        good.append(FileRow(location, got.text, got.answer, meta, got.messages, got.answer_field))
    return good, bad, blank
