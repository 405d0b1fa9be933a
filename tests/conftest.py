"""Shared test setup: the Triton interpreter on CPU, and a deterministic hypothesis profile for CI.

Locally hypothesis explores new examples on every run (and remembers failures in .hypothesis/);
under CI (CI=true) it uses a fixed derandomized sequence, so a submission's result does not
depend on luck. Run `HYPOTHESIS_PROFILE=explore pytest ...` for a longer search.
"""

import os

from hypothesis import settings

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=1000)
_profile = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else None)
if _profile:
    settings.load_profile(_profile)
