"""Shared test setup: the Triton interpreter on CPU, deterministic seeds, process-group cleanup."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
