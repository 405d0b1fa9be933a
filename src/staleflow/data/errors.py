"""What every data module shares: the one error type and the file suffixes read as data."""

from staleflow.faults import BadInput

SUFFIXES = (".jsonl", ".parquet", ".json")
"""--data.source values with these suffixes are data files, never task names."""
MAX_ROW_BYTES = 1 << 24
"""A row larger than this (16 MiB: a .jsonl line, a parquet or arrow record, a JSON array element) is a
bad row, never decoded."""


class DataError(BadInput, ValueError):
    """Bad data: a missing or unreadable source, a bad row (with bad_rows=error), no valid rows."""
