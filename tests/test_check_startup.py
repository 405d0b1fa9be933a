"""`staleflow check` starts fast (issue 51): it took 14-22 s, 6.3 s of it importing torch._dynamo, which
nn.init.normal_ on a meta tensor pulls in (every model built on the meta device to check shapes or plan
/dev/shm). Checked by what check imports, never by a wall time; scripts/bench_check_startup.py measures
the time against the same-run floor (torch + the tokenizer) and prints the ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_check_startup_default_preset_imports_no_dynamo():
    probe = (
        "import sys\nfrom staleflow.cli import main\n"
        "try:\n    main(['check'])\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, 'torch._dynamo' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = _python(probe)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["0", "False", "True"], out.stdout  # it did load the tokenizer


def test_check_startup_meta_models_draw_nothing_and_keep_their_shapes():
    code = (
        "import sys, torch\n"
        "from staleflow.plan.architecture import model_config\n"
        "from staleflow.model.args import ModelArgs\n"
        "from staleflow.model.meta import on_meta\n"
        "from staleflow.model.transformer import CausalLM\n"
        "args = ModelArgs.from_hf_config(model_config('tiny-llama'))\n"
        "with on_meta():\n    a = CausalLM(args)\n"
        "dyn = 'torch._dynamo' in sys.modules\n"
        "real = torch.nn.Embedding(4, 3)\n"  # outside the context: initialised as before
        "with torch.device('meta'):\n    b = CausalLM(args)\n"
        "same = {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}\n"
        "print(dyn, same, all(p.is_meta for p in a.parameters()), bool(real.weight.abs().sum() > 0))\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True", "True"]


@pytest.mark.scripts_smoke
def test_check_startup_bench_prints_the_floor_the_old_path_and_the_ratios():
    out = subprocess.run(
        [sys.executable, "scripts/bench_check_startup.py", "--reps", "1", "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("hardware: ")
    assert any(ln.startswith("torch + the model's tokenizer") for ln in lines)
    result = json.loads(lines[-1])
    for key in ("check_s", "floor_s", "old_path_s", "python_s", "ratio_vs_floor", "ratio_vs_old_path"):
        assert result[key] > 0, key
    assert result["imports_dynamo"] is False and result["ratio_vs_floor"] == pytest.approx(
        result["check_s"] / result["floor_s"], rel=1e-2
    )
