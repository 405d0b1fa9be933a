"""The GPU install path (issue 36): ``bash scripts/setup_env.sh --cuda`` checks the driver against
requirements-gpu.lock before installing anything; launch.sh and ``staleflow check`` refuse a CPU-only
torch on a machine whose nvidia-smi lists GPUs, in one line naming that command; a Hub id (the
gpu-7b preset's model) resolves from the local Hugging Face cache or says how to download it.
nvidia-smi is faked by a script on PATH; nothing is installed (STALEFLOW_SETUP_DRY_RUN prints pip's commands).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CPU_TORCH = torch.version.cuda is None


def _fake_smi(tmp_path: Path, gpus: int = 1, driver: str = "580.95.05") -> Path:
    """A folder with an nvidia-smi that lists ``gpus`` H100s with ``driver``."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    lines = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})" for i in range(gpus))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f"  *-L*) printf '%s\\n' '{lines}' | grep . ;;\n"
        f"  *driver_version*) [ {gpus} -gt 0 ] && echo '{driver}' ;;\n"
        "  *) ;;\n"
        "esac\n"
        "exit 0\n"
    )
    smi.chmod(0o755)
    return bin_dir


def _env(tmp_path: Path, fake: Path | None, **extra) -> dict:
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in (str(fake) if fake else "", venv_bin, "/usr/bin", "/bin") if p)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "STALEFLOW_DEPS")}
    return {**env, "PATH": path, **extra}


def _setup(tmp_path, fake, *args, **extra) -> subprocess.CompletedProcess:
    env = _env(tmp_path, fake, VENV=str(tmp_path / "venv"), STALEFLOW_SETUP_DRY_RUN="1", **extra)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_env.sh"), *args], capture_output=True, text=True, timeout=60, env=env
    )


def _one_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.startswith("staleflow")]
    assert len(lines) == 1, text
    return lines[0]


def test_gpu_install_lock_pins_torch_and_vllm_with_a_driver_floor():
    text = (ROOT / "requirements-gpu.lock").read_text()
    pins = dict(ln.split("==", 1) for ln in text.splitlines() if "==" in ln and not ln.startswith("#"))
    assert pins["vllm"] == "0.33.0" and pins["torch"] == "2.14.0"  # vLLM 0.33 pins torch 2.14 (FACTS.md)
    assert "flash-attn" in pins and pins["triton"] and "staleflow" not in pins
    assert "# cuda 13.0" in text.splitlines() and any(ln.startswith("# min-driver 5") for ln in text.splitlines())


def test_gpu_install_setup_refuses_an_old_driver_before_installing(tmp_path):
    proc = _setup(tmp_path, _fake_smi(tmp_path, driver="535.54.03"), "--cuda")
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert "driver 535.54.03 is older than 580.65.06" in line and "torch==2.14.0" in line
    assert not (tmp_path / "venv").exists() and "+ pip" not in proc.stdout


def test_gpu_install_setup_refuses_without_a_gpu(tmp_path):
    proc = _setup(tmp_path, None, "--cuda")
    assert proc.returncode == 2 and "needs an NVIDIA driver and nvidia-smi" in _one_line(proc.stderr)
    proc = _setup(tmp_path, _fake_smi(tmp_path, gpus=0), "--cuda")
    assert proc.returncode == 2 and "lists no GPU" in _one_line(proc.stderr)


def test_gpu_install_setup_installs_cuda_torch_vllm_and_flash_attn_from_the_gpu_lock(tmp_path):
    proc = _setup(tmp_path, _fake_smi(tmp_path, gpus=8, driver="580.95.05"), "--cuda")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "8 GPU(s), driver 580.95.05 >= 580.65.06 (CUDA 13.0)" in out
    cmds = [ln for ln in out.splitlines() if ln.startswith("+ ")]
    assert cmds[0] == f"+ python3 -m venv {tmp_path / 'venv'}"
    torch_i = next(i for i, c in enumerate(cmds) if c.endswith(" torch==2.14.0"))
    vllm_i = next(i for i, c in enumerate(cmds) if "vllm==0.33.0" in c and "-e .[test]" in c)
    flash_i = next(i for i, c in enumerate(cmds) if "--no-build-isolation" in c and "flash-attn==2.8.3.post2" in c)
    assert torch_i < vllm_i < flash_i  # torch first, flash-attn built against it last
    assert all(" -c " in cmds[i] for i in (torch_i, vllm_i, flash_i))  # every install constrained by the lock


def test_gpu_install_setup_keeps_the_old_switches_and_refuses_unknown_arguments(tmp_path):
    proc = _setup(tmp_path, None, "--gpu")
    assert proc.returncode == 2 and "unknown argument '--gpu'" in _one_line(proc.stderr)
    proc = _setup(tmp_path, None, TORCH_SPEC="torch")
    assert proc.returncode == 0 and "+ pip install -q torch" in proc.stdout.splitlines()
    proc = _setup(tmp_path, None)
    assert proc.returncode == 0 and any(ln.endswith("torch==2.13.0") for ln in proc.stdout.splitlines())


@pytest.mark.skipif(not CPU_TORCH, reason="this torch is a CUDA build")
def test_gpu_install_check_refuses_a_cpu_torch_on_a_gpu_node(tmp_path):
    env = _env(tmp_path, _fake_smi(tmp_path, gpus=2), STALEFLOW_NPROC="3")
    proc = subprocess.run(
        [sys.executable, "-m", "staleflow", "check", "--preset", "tiny", "--log.run-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert "2 NVIDIA GPU(s)" in line and "CPU-only" in line and line.endswith("bash scripts/setup_env.sh --cuda")


@pytest.mark.skipif(not CPU_TORCH, reason="this torch is a CUDA build")
def test_gpu_install_launch_sh_refuses_a_cpu_torch_before_starting_anything(tmp_path):
    env = _env(tmp_path, _fake_smi(tmp_path, gpus=8), VIRTUAL_ENV=str(Path(sys.executable).parents[1]))
    proc = subprocess.run(
        ["bash", str(ROOT / "launch.sh"), "--preset", "tiny"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2 and "torchrun" not in proc.stderr.lower()
    assert "bash scripts/setup_env.sh --cuda" in _one_line(proc.stderr)


def test_gpu_install_check_passes_where_nvidia_smi_lists_no_gpu(tmp_path):
    from staleflow.launch.environment import check_gpu_torch, main

    check_gpu_torch(gpus=[])  # no GPU listed: nothing to refuse, whatever torch is
    env = _env(tmp_path, _fake_smi(tmp_path, gpus=0))
    proc = subprocess.run(
        [sys.executable, "-m", "staleflow.launch.environment", "--gpu-torch"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0 and proc.stderr == ""
    assert main(["--bad"]) == 2


def test_gpu_install_check_names_a_cuda_torch_that_sees_no_gpu():
    from types import SimpleNamespace

    from staleflow.config import ConfigError
    from staleflow.launch.environment import check_gpu_torch

    fake = SimpleNamespace(
        __version__="2.14.0", version=SimpleNamespace(cuda="13.0"), cuda=SimpleNamespace(is_available=lambda: False)
    )
    with pytest.raises(ConfigError, match=r"CUDA 13.0\) sees none .*setup_env.sh --cuda"):
        check_gpu_torch(fake, gpus=["GPU 0: NVIDIA H100"])


# ---- the gpu-7b preset's model from the Hugging Face cache ----------------------------------------
def _hf_cache(root: Path, repo: str, rev: str = "abc123", weights: bool = True) -> Path:
    folder = root / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    if weights:
        (snap / "model.safetensors").write_bytes(b"")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(rev)
    return snap


def test_gpu_install_hub_id_resolves_from_the_hf_cache(tmp_path, monkeypatch):
    from staleflow.model.aliases import ALIASES, ensure_alias, hub_cache_root

    cache = tmp_path / "hub"
    old = _hf_cache(cache, "Qwen/Qwen2.5-7B-Instruct", rev="old000")
    snap = _hf_cache(cache / "x", "Qwen/Qwen2.5-7B-Instruct")  # another cache: HF_HUB_CACHE chooses
    monkeypatch.setenv("HF_HUB_CACHE", str(cache / "x"))
    assert hub_cache_root() == cache / "x"
    assert "Qwen/Qwen2.5-7B-Instruct" in ALIASES and ensure_alias("Qwen/Qwen2.5-7B-Instruct") == snap
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub
    assert ensure_alias("Qwen/Qwen2.5-7B-Instruct") == old
    from staleflow.model.loader import resolve_model_path

    assert resolve_model_path("Qwen/Qwen2.5-7B-Instruct") == str(old)
    assert "smollm2-135m" in ALIASES and "not/an/id" not in ALIASES and str(tmp_path) not in ALIASES


def test_gpu_install_hub_id_missing_from_the_cache_says_how_to_download_it(tmp_path, monkeypatch):
    from staleflow.model.aliases import AliasError, ensure_alias

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(AliasError) as e:
        ensure_alias("Qwen/Qwen2.5-7B-Instruct")
    msg = str(e.value)
    assert "\n" not in msg and "hf download Qwen/Qwen2.5-7B-Instruct" in msg and "huggingface-cli download" in msg
    _hf_cache(tmp_path / "partial", "Org/Model", weights=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "partial"))
    with pytest.raises(AliasError, match="only partly in the Hugging Face cache.*hf download Org/Model"):
        ensure_alias("Org/Model")
    # the plan still works without the download (the bundled architecture)
    from staleflow.plan.architecture import model_args

    assert model_args("Qwen/Qwen2.5-7B-Instruct").hidden_size == 3584


def test_gpu_install_mistyped_local_folder_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    """``runs/x`` (one slash) matches a Hub id; when ``runs/`` is a folder here, the error names the
    missing folder (the likely typo), not a download command for a Hub repo called ``runs/x``."""
    from staleflow.model.aliases import AliasError
    from staleflow.model.loader import resolve_model_path

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(AliasError) as e:
        resolve_model_path("runs/x")
    msg = str(e.value)
    assert "\n" not in msg and "model folder 'runs/x' does not exist" in msg and "'runs' does" in msg
    assert "hf download" not in msg
    with pytest.raises(AliasError, match="neither a folder here nor in the local Hugging Face cache"):
        resolve_model_path("Org/Model")  # no Org/ folder here: a Hub id, how to download it


def test_gpu_install_check_leaves_gpus_hidden_on_purpose_alone(monkeypatch):
    """CUDA_VISIBLE_DEVICES="" (or -1) on a GPU node is a deliberate CPU run: not refused with a
    reinstall command; unset, the same machine and torch are refused."""
    from types import SimpleNamespace

    from staleflow.config import ConfigError
    from staleflow.launch.environment import check_gpu_torch

    cpu_torch = SimpleNamespace(__version__="2.13.0+cpu", version=SimpleNamespace(cuda=None))
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        check_gpu_torch(cpu_torch, gpus=["GPU 0: NVIDIA H100"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError, match="CPU-only"):
        check_gpu_torch(cpu_torch, gpus=["GPU 0: NVIDIA H100"])
