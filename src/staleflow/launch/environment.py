"""What the machine must offer a run, checked before any rank starts (launch/check.py calls these).

    check_shm(shm_needed(cfg, nproc, "cpu"))     # /dev/shm has room for the rings (and CPU slots)
    check_flash(cfg)                              # flash-attn, when it will run, really runs here
    print(device_line())                          # CUDA / driver / NCCL / torch / Triton versions
    check_gpu_torch()                             # a CPU-only torch on a machine with NVIDIA GPUs
    python -m staleflow.launch.environment --gpu-torch      # the same, for launch.sh (exit 2 + one line)

Each failure is a ConfigError: one line naming what is missing, how much, and the fix.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

from staleflow.config import ConfigError

MiB = 1 << 20
GPU_SETUP = "bash scripts/setup_env.sh --cuda"
"""The one command that sets up a GPU node (CUDA torch, flash-attn and vLLM from requirements-gpu.lock)."""
NO_FLASH_ENV = "STALEFLOW_NO_FLASH_ATTN"
"""Set to 1: the trainer's attention uses PyTorch SDPA even where flash-attn is installed."""


def shm_needed(cfg, nproc: int, device_type: str, rollout_here: int | None = None) -> tuple[int, str]:
    """(bytes this node's ranks put in /dev/shm, what they are): one trajectory ring per rollout
    rank on it (``rollout_here``, else all of the run's), and on CPU the Parameter Server's two
    slots (on GPU they live in device memory)."""
    from staleflow.servers.ring import align_up
    from staleflow.servers.trajectory import DEFAULT_RING_BYTES, RING_HEADER_BYTES

    rollout = rollout_here if rollout_here is not None else min(cfg.rollout.ranks, nproc or cfg.rollout.ranks)
    ring = RING_HEADER_BYTES + align_up(DEFAULT_RING_BYTES)
    need, what = rollout * ring, f"{rollout} trajectory ring(s) of {DEFAULT_RING_BYTES // MiB} MiB"
    if device_type != "cuda":
        from staleflow.cluster.placement import slot_dtype
        from staleflow.plan.architecture import meta_model, model_args
        from staleflow.servers.layout import ParamLayout

        dtype = slot_dtype(cfg, device_type)
        layout = ParamLayout.from_named_tensors(
            meta_model(model_args(cfg.model.path), dtype).named_parameters(), dtype=dtype
        )
        need += 2 * layout.nbytes
        what += f" + two weight slots of {layout.nbytes / MiB:.0f} MiB"
    return need, what


def check_shm(needed: tuple[int, str], path: str | None = None, statvfs=None) -> int:
    """Raise ConfigError when ``path`` (/dev/shm) has less free space than ``needed`` (bytes, what);
    return the free bytes. A container's default /dev/shm is 64 MB."""
    from staleflow.servers.segment import SHM_DIR

    path = path or SHM_DIR
    nbytes, what = needed
    st = (statvfs or os.statvfs)(path)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        size_g = max(1, -(-int(nbytes * 1.25) // (1 << 30)))
        raise ConfigError(
            f"{path} has {free / MiB:.0f} MiB free, this run needs {nbytes / MiB:.0f} MiB there ({what}): "
            f"give the container more shared memory (docker run --shm-size={size_g}g, or remount /dev/shm "
            f"larger) or run fewer rollout ranks on this node (--rollout.ranks)"
        )
    return free


def flash_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flash_probe(device: str = "cuda") -> str:
    """Run flash-attn's varlen kernel once on ``device`` (two sequences, GQA, bf16) and compare it with
    SDPA; "" when it works, else the reason (a build for another torch/CUDA fails to import or to run)."""
    try:
        import torch
        import torch.nn.functional as F
        from flash_attn import flash_attn_varlen_func

        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(9, 4, 64, generator=g).to(device, torch.bfloat16)  # [T, H, D]
        kv = torch.randn(2, 9, 2, 64, generator=g).to(device, torch.bfloat16)  # K, V: [T, Hkv, D]
        cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
        out = flash_attn_varlen_func(q, kv[0], kv[1], cu, cu, 5, 5, causal=True)
        for a, b in ((0, 4), (4, 9)):
            k, v = (x[a:b].repeat_interleave(2, dim=1).transpose(0, 1) for x in kv)
            ref = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k, v, is_causal=True).transpose(0, 1)
            err = (out[a:b].float() - ref.float()).abs().max().item()
            if not err < 5e-2:
                return f"its output differs from SDPA by {err:.3g}"
        return ""
    except Exception as e:  # ImportError (undefined symbol), RuntimeError (no kernel image), ...
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def check_flash(cfg, cuda: bool | None = None, probe=flash_probe) -> bool:
    """On CUDA, where flash-attn is installed and not switched off, run it once: a build that does
    not match this torch is one line here instead of a crash at the first forward. True when it ran."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda or not flash_installed() or os.environ.get(NO_FLASH_ENV) == "1":
        return False
    why = probe("cuda")
    if why:
        import torch

        raise ConfigError(
            f"flash-attn is installed but does not run with torch {torch.__version__} (CUDA {torch.version.cuda}): "
            f"{why}; reinstall it for this torch (pip install --force-reinstall --no-build-isolation flash-attn) "
            f"or run without it ({NO_FLASH_ENV}=1 for the trainer, --rollout.decode-backend triton for the engine)"
        )
    return True


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.split("\n")[0].strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def device_line(torch_module=None) -> str:
    """One line with the CUDA runtime, driver, NCCL, torch and Triton versions and the GPUs; "" off CUDA."""
    torch = torch_module
    if torch is None:
        import torch
    if not torch.cuda.is_available():
        return ""
    try:
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # a torch built without NCCL
        nccl = "none"
    try:
        import triton

        tri = triton.__version__
    except ImportError:
        tri = "none"
    n = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    return (
        f"staleflow: CUDA {torch.version.cuda} (driver {_driver_version()}), NCCL {nccl}, torch {torch.__version__}, "
        f"Triton {tri}, {n} x {props.name} ({props.total_memory / (1 << 30):.1f} GiB)"
    )


def nvidia_gpus(timeout: float = 20) -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists ("GPU 0: NVIDIA H100 ..."); [] without nvidia-smi or a driver."""
    import shutil

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return []
    return (
        [ln.strip() for ln in out.stdout.splitlines() if ln.strip().startswith("GPU ")] if out.returncode == 0 else []
    )


def check_gpu_torch(torch_module=None, gpus: list[str] | None = None) -> None:
    """ConfigError when nvidia-smi lists GPUs but this torch cannot use them: a CPU-only build (the
    quick start's .venv) would run the CPU layout on a GPU node, or fail on the world size. GPUs hidden
    on purpose (``CUDA_VISIBLE_DEVICES`` empty or -1: a CPU run on a GPU node) are not refused."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return
    gpus = nvidia_gpus() if gpus is None else gpus
    if not gpus:
        return
    torch = torch_module
    if torch is None:
        import torch
    if torch.version.cuda is None:
        raise ConfigError(
            f"this machine has {len(gpus)} NVIDIA GPU(s) (nvidia-smi) but torch {torch.__version__} is a CPU-only "
            f"build: set up the GPU environment with {GPU_SETUP}"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"this machine has {len(gpus)} NVIDIA GPU(s) (nvidia-smi) but torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}) sees none (driver {_driver_version()} too old for it, or CUDA_VISIBLE_DEVICES "
            f"hides them): rerun {GPU_SETUP}, which checks the driver"
        )


def main(argv: list[str]) -> int:
    """``python -m staleflow.launch.environment --gpu-torch``: check_gpu_torch as a command (launch.sh)."""
    import sys

    if argv != ["--gpu-torch"]:
        print("usage: python -m staleflow.launch.environment --gpu-torch", file=sys.stderr)
        return 2
    try:
        check_gpu_torch()
    except ConfigError as e:
        print(f"staleflow: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
