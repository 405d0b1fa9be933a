"""scripts/device_check_steps.py on CPU: the same code paths as its GPU steps (gloo instead of NCCL,
chunked vs naive log-probs instead of Triton vs chunked, shared-memory slots instead of CUDA IPC
pieces), so the prepared device check does not rot between GPU sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.scripts_smoke]  # a row of tests/test_scripts_smoke.py
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check_steps.py"


@pytest.mark.parametrize("step", ["trainer", "ps"])
def test_device_check_step_runs_on_cpu(step):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), step, "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env
    )
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and res["ok"] is True, proc.stdout[-2000:] + proc.stderr[-2000:]
    if step == "trainer":
        assert res["chunked"]["fsdp2_sharded"] and res["loss_rel_diff"] < 1e-6
    else:
        assert [p["exact"] for p in res["pulls"]] == [True] * 4 and {p["reader"] for p in res["pulls"]} == {2, 3}
