"""What every data module shares: the one error type and the file suffixes read as data."""

from staleflow.faults import BadInput

SUFFIXES = (".jsonl", ".parquet", ".json")
"""--data.source values with these suffixes are data files, never task names."""


class DataError(BadInput, ValueError):
    """Bad data: a missing or unreadable source, a bad row (with bad_rows=error), no valid rows."""
