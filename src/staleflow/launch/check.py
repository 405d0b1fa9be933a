"""``python -m staleflow check [train flags]``: everything about a run that can be checked before
any process starts. launch.sh runs it first, so a bad flag, a missing model folder or package,
an extension that does not resolve (--reward.fn, --train.loss / advantage / off-policy,
--coordinator.routing / pull, --env.name, --data.source: a bad import path or an object of the wrong shape), an
unknown --coordinator.cost-model, a data source that cannot be read or whose first rows lack the
fields asked for, a prompt + --rollout.max-new-tokens over --rollout.max-model-len (or that over
the model's max_position_embeddings), an optional package the flags need (vllm, wandb,
flash-attn), more trainer ranks than GPUs (launch/preflight.py), an unwritable run folder, a
--resume that cannot work, a /dev/shm too small for the run's shared memory
or a flash-attn build that does not run with this torch is one line and exit 2, printed once,
with no torchrun traceback and no elastic restarts of a doomed run. On CUDA it prints the CUDA,
driver, NCCL, torch and Triton versions.

It also builds the model alias on first use (one process, before torchrun starts the ranks).
STALEFLOW_NPROC (set by launch.sh) is the number of processes the run will have.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from staleflow.config import ConfigError, RunConfig, resolve
from staleflow.launch.preflight import check_data, check_extras, check_gpus
from staleflow.presets import PRESETS

ABOUT = (
    "staleflow check: everything about a run that can be checked before any process starts (the flags, the "
    "model folder, extensions, data, packages, GPUs, /dev/shm, the run folder); each problem is one line and "
    "exit 2, else exit 0 and nothing is started. ./launch.sh runs it first. It takes train's flags:"
)
"""The opening of ``check --help``."""


def check(argv: list[str]) -> RunConfig:
    from staleflow.cluster.roles import Roles
    from staleflow.config.parse import parse, split_preset
    from staleflow.model.loader import resolve_model_path

    defaults, _ = split_preset(argv, PRESETS, "smollm2-cpu")
    cfg = resolve(parse(RunConfig, argv, PRESETS, default="smollm2-cpu", prog="staleflow check", about=ABOUT))
    nproc = os.environ.get("STALEFLOW_NPROC")
    if nproc:
        Roles(int(nproc), cfg.rollout.ranks)
    from staleflow.launch.resume import protect_run_folders

    protect_run_folders(cfg, cfg.resume)  # no extension module from a run folder (launch/saved_code.py)
    if cfg.resume:
        from staleflow.config.parse import given_flags
        from staleflow.launch.resume import check_resume

        cfg = check_resume(cfg, defaults, given_flags(argv))
    from staleflow.model.hf import lazy_folder

    resolve_model_path(cfg.model.path)  # an alias is built on first use, here, before torchrun starts
    with ThreadPoolExecutor(1, thread_name_prefix="staleflow-verify") as pool:
        # An alias' cached files are hashed against their build marker (rebuilt if they changed): ~0.5 s
        # of hashing and reading that releases the GIL, while this thread imports transformers'
        # tokenizer code (~1 s). Nothing reads the model folder until the hashes are checked.
        verified = pool.submit(resolve_model_path, cfg.model.path, True)
        check_extensions(cfg)
        check_extras(cfg)
        import_tokenizer_code()
        folder = verified.result()
    lazy_folder(folder)  # config.json and every safetensors header
    check_data(cfg, folder)
    check_writable(cfg.resume or cfg.log.run_dir, "--resume" if cfg.resume else "--log.run-dir")
    check_machine(cfg, int(nproc) if nproc else 0)
    return cfg


def import_tokenizer_code() -> None:
    """Import what loading a fast tokenizer imports (check_data loads the model's), ahead of time."""
    import transformers.models.auto.tokenization_auto  # noqa: F401
    import transformers.tokenization_utils_tokenizers  # noqa: F401
    from transformers.activations import ACT2FN  # noqa: F401  (the config classes' type validators import it)


def check_machine(cfg: RunConfig, nproc: int) -> None:
    """/dev/shm has room for what this node's ranks put there; on CUDA the versions are printed
    and flash-attn, where it will run, is run once (launch/environment.py)."""
    import torch

    from staleflow.launch.environment import check_flash, check_gpu_torch, check_shm, device_line, shm_needed

    check_gpu_torch(torch)  # issue 36: a CPU-only torch on a machine whose nvidia-smi lists GPUs
    cuda = torch.cuda.is_available()
    if cfg.rollout.cuda_graphs and not cuda:
        raise ConfigError("--rollout.cuda-graphs needs CUDA (captured decode steps) and this machine has none: drop it")
    check_shm(shm_needed(cfg, nproc, "cuda" if cuda else "cpu"))
    check_gpus(cfg, nproc, torch.cuda.device_count() if cuda else 0)
    if cuda:
        print(device_line(torch), file=sys.stderr, flush=True)
        check_flash(cfg, cuda=True)


def check_extensions(cfg: RunConfig) -> None:
    """Every extension point resolves, through the registry the run itself uses, to an object of the
    right shape: a registered name or an importable 'package.module:name' (ExtensionError otherwise)."""
    from staleflow.coordinator.cost_model import CostModelError, load_cost_model
    from staleflow.coordinator.strategies import PULL, ROUTING
    from staleflow.data.tasks import task_for
    from staleflow.reward.functions import REWARDS
    from staleflow.train.advantages import ADVANTAGES
    from staleflow.train.losses import LOSSES, OFF_POLICIES

    for registry, spec in (
        (REWARDS, cfg.reward.fn),
        (LOSSES, cfg.train.loss),
        (ADVANTAGES, cfg.train.advantage),
        (OFF_POLICIES, cfg.train.off_policy),
        (ROUTING, cfg.coordinator.routing),
        (PULL, cfg.coordinator.pull),
    ):
        registry.resolve(spec)
    if cfg.env.name:
        from staleflow.env import make_env

        make_env(cfg.env)  # resolves --env.name and builds one (the python env checks its sandbox)
    for name, _ in cfg.data.sources:
        task_for(name)  # a task name or import path resolves; data sources are read by check_data
    try:
        load_cost_model(cfg.coordinator.cost_model)
    except CostModelError as e:
        raise ConfigError(f"--coordinator.cost-model={cfg.coordinator.cost_model!r}: {e}") from None
    if cfg.reward.model:  # a folder that is no usable reward model stops the run here, before any rank starts
        from staleflow.reward.model_scorer import check_reward_model_folder

        check_reward_model_folder(cfg.reward.model)
    if cfg.reward.fn == "code_tests":  # it runs the policy's code: refuse up front where the sandbox cannot start
        from staleflow.sandbox import sandbox_unavailable

        if problem := sandbox_unavailable():
            raise ConfigError(f"--reward.fn=code_tests needs the sandbox: {problem}")


def check_writable(folder: str, flag: str) -> None:
    """The run folder (or the folder run folders are made in) exists or can be made, and takes a file."""
    import tempfile

    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".staleflow-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{flag}={folder!r} is not writable ({e.strerror}): make it writable or give another folder"
        ) from None


def main(argv: list[str]) -> int:
    from staleflow.faults import start_outcome

    try:
        check(argv)
    except Exception as e:  # bad input (the fault table, faults.py): one line, exit 2; a bug propagates
        said = start_outcome(e)
        if said is None:
            raise
        print(said[0], file=sys.stderr, flush=True)
        return said[1]
    return 0
