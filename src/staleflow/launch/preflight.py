"""Checks of a run's inputs that need no model weights (called by ``staleflow check``, launch/check.py):

- data: every source of --data.source / --data.mix is readable and its first rows have the fields
  asked for (a built-in or fork task: its first rows are generated); the longest of those prompts
  plus --rollout.max-new-tokens fits --rollout.max-model-len, which fits the model's own
  max_position_embeddings (config.json);
- engine and extras: --rollout.engine resolves to a backend (staleflow.engines) and the optional
  packages the flags ask for are installed (the engine's extras, wandb, flash-attn);
- GPUs: on CUDA, no more trainer ranks than GPUs (NCCL puts one rank on one GPU).
Each refusal is one ConfigError line; launch.sh then exits 2 before torchrun starts a rank.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from staleflow.config import ConfigError, RunConfig

PROBE_ROWS = 8
"""Rows read from each data source (and prompts generated from each task)."""


def check_data(cfg: RunConfig, folder: str) -> None:
    """Every data source readable with its fields present, and the lengths consistent (module docstring)."""
    from staleflow.data import DataError
    from staleflow.data.files import read_rows
    from staleflow.data.render import PromptRenderer
    from staleflow.data.tasks import task_for
    from staleflow.model import load_tokenizer

    prompts = []
    try:
        for name, _ in cfg.data.sources:
            task = task_for(name)
            if task is not None:
                prompts += [task(cfg.data.seed, k)[0] for k in range(PROBE_ROWS)]
                continue
            rows, bad, _ = read_rows(name, cfg.data, limit=PROBE_ROWS)
            if not rows:
                why = f"; row {bad[0].location}: {bad[0].reason}" if bad else " (it is empty)"
                raise ConfigError(f"--data.source={name!r}: none of its first {PROBE_ROWS} rows is usable{why}")
            prompts += [r.messages or r.text for r in rows]
        from staleflow.env import env_schemas

        tools = env_schemas(cfg.env)  # the prompts of a multi-turn run show its tools: longer
        ids = PromptRenderer(cfg.data, load_tokenizer(folder), tools, cfg.env.tool_format).encode(prompts)
    except DataError as e:
        raise ConfigError(str(e)) from None
    check_lengths(cfg, max(len(x) for x in ids), folder)


def check_lengths(cfg: RunConfig, longest_prompt: int, folder: str) -> None:
    r = cfg.rollout
    if r.max_new_tokens >= r.max_model_len:
        raise ConfigError(
            f"--rollout.max-new-tokens={r.max_new_tokens} leaves no room for a prompt in "
            f"--rollout.max-model-len={r.max_model_len}: lower the first or raise the second"
        )
    if longest_prompt + r.max_new_tokens > r.max_model_len:
        raise ConfigError(
            f"a prompt of {longest_prompt} tokens (among the first rows of the data) + --rollout.max-new-tokens="
            f"{r.max_new_tokens} > --rollout.max-model-len={r.max_model_len}: raise --rollout.max-model-len "
            f"or lower --rollout.max-new-tokens"
        )
    try:
        limit = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        limit = None
    if isinstance(limit, int) and not isinstance(limit, bool) and r.max_model_len > limit:
        raise ConfigError(
            f"--rollout.max-model-len={r.max_model_len} > the model's max_position_embeddings={limit} "
            f"(config.json of {folder}): lower --rollout.max-model-len"
        )


def check_extras(cfg: RunConfig) -> None:
    """--rollout.engine resolves (ExtensionError otherwise) and the optional packages the run's flags need are installed."""
    from staleflow.engines import engine_backend

    wanted = [(module, f"--rollout.engine {cfg.rollout.engine}", fix) for module, fix in engine_backend(cfg).extras]
    if cfg.log.wandb:
        wanted.append(("wandb", "--log.wandb", "pip install 'staleflow[wandb]' (or drop --log.wandb)"))
    if cfg.rollout.decode_backend == "flash":
        wanted.append(("flash_attn", "--rollout.decode-backend flash", "pip install flash-attn on a CUDA machine"))
    for module, flag, fix in wanted:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs the package {module}, which is not installed: {fix}")


def check_gpus(cfg: RunConfig, nproc: int, cuda_devices: int) -> None:
    """On CUDA: at most one trainer rank per GPU (NCCL cannot put two ranks of its group on one GPU)."""
    trainers = nproc - cfg.rollout.ranks
    if cuda_devices and trainers > cuda_devices:
        raise ConfigError(
            f"{nproc} processes with --rollout.ranks={cfg.rollout.ranks} make {trainers} trainer ranks but "
            f"this machine has {cuda_devices} GPU(s): set NPROC <= {cuda_devices + cfg.rollout.ranks} "
            f"or raise --rollout.ranks"
        )
