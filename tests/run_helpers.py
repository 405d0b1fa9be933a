"""The tests' one way to run the main job for real: ``staleflow train --preset tiny`` under torchrun (3 ranks).

    out = train_tiny(tmp_path, "run", "--steps", "4", *QUIET)   # asserts exit 0, returns the output
    rows = metrics_rows(tmp_path / "run")                          # its metrics.jsonl, one dict per row

The run gets a tag of its own (test_launch finds its processes by it), this folder on PYTHONPATH (the tests'
reward modules, e.g. ``e2e_rewards:text_length``, a reward that varies: a learning signal), and its process
group is killed whatever happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUIET = ("--log.no-progress", "--log.no-plot", "--log.no-tensorboard", "--checkpoint.no-export-hf")
"""Flags for a run whose plots, TensorBoard files and Hugging Face export no test reads."""


def train_tiny(run_dir, name: str, *flags: str, reward: str = "e2e_rewards:text_length", timeout: float = 600) -> str:
    """Run the tiny preset into run_dir/name with ``flags`` after the defaults; assert it exits 0; its output."""
    from test_launch import TORCHRUN, _kill_group

    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, STALEFLOW_TEST_TAG=uuid.uuid4().hex, PYTHONPATH=path)
    cmd = [*TORCHRUN, "-m", "staleflow", "train", "--preset", "tiny", "--log.run-dir", str(run_dir)]
    cmd += ["--log.name", name, "--reward.fn", reward, *flags]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    return out


def metrics_rows(run: Path) -> list[dict]:
    """A run folder's metrics.jsonl (step rows and evaluation rows, superseded ones included)."""
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]
