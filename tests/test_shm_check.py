"""Start-up checks of the machine (launch/environment.py, run by ``staleflow check``): /dev/shm has
room for the run's rings (and the CPU weight slots), flash-attn runs where it will be used, and the
CUDA stack's versions are printed. Each failure is one line naming the size or cause and the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from staleflow.config import ConfigError
from staleflow.launch import environment as env
from staleflow.presets import PRESETS

MiB = 1 << 20


def _statvfs(free_bytes: int):
    return lambda path: SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096)


def _tiny():
    from staleflow.config import RunConfig, resolve
    from staleflow.config.parse import parse

    return resolve(parse(RunConfig, ["--preset", "tiny"], PRESETS, default="smollm2-cpu", prog="staleflow train"))


def test_shm_check_counts_one_ring_per_rollout_rank_and_the_cpu_slots():
    from staleflow.cluster.placement import slot_dtype
    from staleflow.plan.architecture import meta_model, model_args
    from staleflow.servers.layout import ParamLayout
    from staleflow.servers.trajectory import DEFAULT_RING_BYTES, RING_HEADER_BYTES

    cfg = _tiny()
    rings = cfg.rollout.ranks * (RING_HEADER_BYTES + DEFAULT_RING_BYTES)
    gpu, what = env.shm_needed(cfg, 3, "cuda")
    assert gpu == rings and f"{cfg.rollout.ranks} trajectory ring(s) of 256 MiB" in what
    dtype = slot_dtype(cfg, "cpu")
    slots = ParamLayout.from_named_tensors(
        meta_model(model_args(cfg.model.path), dtype).named_parameters(), dtype=dtype
    )
    assert env.shm_needed(cfg, 3, "cpu")[0] == rings + 2 * slots.nbytes


def test_shm_check_refuses_a_container_default_dev_shm_with_the_size_and_the_fix():
    need = (3 * 256 * MiB, "3 trajectory ring(s) of 256 MiB")
    with pytest.raises(ConfigError) as e:
        env.check_shm(need, path="/dev/shm", statvfs=_statvfs(64 * MiB))
    msg = str(e.value)
    assert "\n" not in msg
    assert "/dev/shm has 64 MiB free, this run needs 768 MiB" in msg
    assert "docker run --shm-size=1g" in msg and "--rollout.ranks" in msg
    assert env.check_shm(need, path="/dev/shm", statvfs=_statvfs(1024 * MiB)) == 1024 * MiB


def test_shm_check_makes_staleflow_check_exit_2_with_one_line(monkeypatch, capsys):
    from staleflow.launch import check

    monkeypatch.setattr(env.os, "statvfs", _statvfs(64 * MiB))
    assert check.main(["--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MiB free, this run needs" in err[0] and "--shm-size" in err[0]


def test_shm_check_flash_attn_that_does_not_run_is_one_line_naming_reinstall_and_the_fallback(monkeypatch):
    monkeypatch.setattr(env, "flash_installed", lambda: True)
    monkeypatch.delenv(env.NO_FLASH_ENV, raising=False)
    calls = []

    def broken(device):
        calls.append(device)
        return "ImportError: flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"

    with pytest.raises(ConfigError) as e:
        env.check_flash(None, cuda=True, probe=broken)
    msg = str(e.value)
    assert calls == ["cuda"] and "\n" not in msg and "undefined symbol" in msg
    assert "pip install --force-reinstall --no-build-isolation flash-attn" in msg
    assert f"{env.NO_FLASH_ENV}=1" in msg and "--rollout.decode-backend triton" in msg
    assert env.check_flash(None, cuda=True, probe=lambda d: "") is True
    assert env.check_flash(None, cuda=False, probe=broken) is False and calls == ["cuda"]  # no CUDA: no probe
    monkeypatch.setenv(env.NO_FLASH_ENV, "1")
    assert env.check_flash(None, cuda=True, probe=broken) is False  # switched off: not probed, not used


def test_shm_check_flash_switch_turns_the_trainers_flash_path_off(monkeypatch):
    from staleflow.model import attention

    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv(env.NO_FLASH_ENV, raising=False)
    assert attention._flash_available()
    monkeypatch.setenv(env.NO_FLASH_ENV, "1")
    assert not attention._flash_available()


def test_shm_check_device_line_names_cuda_nccl_torch_and_the_gpus(monkeypatch):
    monkeypatch.setattr(env, "_driver_version", lambda: "580.65")
    fake = SimpleNamespace(
        __version__="2.11.0+cu130",
        version=SimpleNamespace(cuda="13.0"),
        cuda=SimpleNamespace(
            is_available=lambda: True,
            nccl=SimpleNamespace(version=lambda: (2, 27, 3)),
            device_count=lambda: 1,
            get_device_properties=lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=143 << 30),
        ),
    )
    line = env.device_line(fake)
    assert line.startswith("staleflow: CUDA 13.0 (driver 580.65), NCCL 2.27.3, torch 2.11.0+cu130, Triton ")
    assert line.endswith("1 x NVIDIA H200 (143.0 GiB)")
    off = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False))
    assert env.device_line(off) == ""


def test_shm_check_at_rank_zero_start_counts_this_nodes_rings(monkeypatch):
    """A run started without launch.sh's check (torchrun directly): rank 0 refuses it before any
    ring exists (a ring in a full tmpfs dies of SIGBUS at its first write, with no message)."""
    from staleflow.cluster.roles import Roles
    from staleflow.cluster.topology import Topology
    from staleflow.launch.entry import _shm_refusal

    cfg = _tiny()
    roles = Roles(3, cfg.rollout.ranks)
    need = env.shm_needed(cfg, 3, "cpu", rollout_here=cfg.rollout.ranks)[0]
    monkeypatch.setattr(env.os, "statvfs", _statvfs(need - 4096))
    msg = _shm_refusal(cfg, roles, Topology.single_node(roles))
    assert "\n" not in msg and f"this run needs {need / MiB:.0f} MiB" in msg and "--shm-size" in msg
    monkeypatch.setattr(env.os, "statvfs", _statvfs(need + 4096))
    assert _shm_refusal(cfg, roles, Topology.single_node(roles)) == ""
