"""One-line pointers from the flag names verl, TRL and OpenRLHF users type to StaleFlow's.

    foreign_flag_hint(["--rollout.n", "8"], known_flags(RunConfig))
    # "--rollout.n is verl's name for it: StaleFlow's is --staleness.group-size (responses per prompt, N)"

config/parse.py asks before tyro parses, so ``--num_generations 8`` or ``--data.train_files x.parquet``
is one line naming our flag instead of tyro's list of look-alikes (``--rollout.n`` used to suggest
--rollout.cuda-graphs). A name that is one of our own flags is never hinted. A foreign name is matched
by its dotted tail (``actor_rollout_ref.rollout.n`` -> ``rollout.n``), dashes read as underscores.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable

# foreign name (a dotted tail, underscores) -> (who calls it that, our flag, what it is)
HINTS: dict[str, tuple[str, str, str]] = {
    "rollout.n": ("verl", "staleness.group_size", "responses per prompt, N"),
    "num_generations": ("TRL", "staleness.group_size", "responses per prompt, N"),
    "n_samples_per_prompt": ("OpenRLHF", "staleness.group_size", "responses per prompt, N"),
    "train_files": ("verl", "data.source", "a .parquet / .jsonl / .json file, a save_to_disk folder, a cached dataset"),
    "val_files": ("verl", "eval.n", "held-out prompts are set aside from --data.source"),
    "dataset_name": ("TRL", "data.source", "a file, a save_to_disk folder or a cached hub dataset"),
    "prompt_data": ("OpenRLHF", "data.source", "a file, a save_to_disk folder or a cached hub dataset"),
    "train_batch_size": ("verl", "staleness.batch_size", "prompt groups per step, B"),
    "per_device_train_batch_size": ("TRL", "staleness.batch_size", "prompt groups per step, B; TRL counts completions"),
    "rollout_batch_size": ("OpenRLHF", "staleness.batch_size", "prompt groups per step, B"),
    "max_response_length": ("verl", "rollout.max_new_tokens", "tokens generated per response"),
    "max_completion_length": ("TRL", "rollout.max_new_tokens", "tokens generated per response"),
    "generate_max_len": ("OpenRLHF", "rollout.max_new_tokens", "tokens generated per response"),
    "max_prompt_length": ("verl and TRL", "data.max_prompt_tokens", "longest prompt kept"),
    "learning_rate": ("TRL", "train.lr", "the optimizer's learning rate"),
    "actor_learning_rate": ("OpenRLHF", "train.lr", "the optimizer's learning rate"),
    "optim.lr": ("verl", "train.lr", "the optimizer's learning rate"),
    "lr": ("verl", "train.lr", "the optimizer's learning rate"),
    "total_training_steps": ("verl", "steps", "training steps (weight versions produced)"),
    "total_epochs": ("verl", "steps", "training steps (weight versions produced)"),
    "max_steps": ("TRL", "steps", "training steps (weight versions produced)"),
    "num_train_epochs": ("TRL", "steps", "training steps (weight versions produced)"),
    "model_name_or_path": ("TRL", "model.path", "a Hugging Face model folder or an alias"),
    "pretrain": ("OpenRLHF", "model.path", "a Hugging Face model folder or an alias"),
    "adv_estimator": ("verl", "train.advantage", "grpo, dr-grpo, rloo or your own"),
    "kl_loss_coef": ("verl", "train.kl_coef", "the KL penalty's weight"),
    "beta": ("TRL", "train.kl_coef", "the KL penalty's weight"),
    "clip_ratio": ("verl", "train.clip_low", "and --train.clip-high: the PPO clip range"),
    "epsilon": ("TRL", "train.clip_low", "and --train.clip-high: the PPO clip range"),
    "entropy_coeff": ("verl", "train.entropy_coef", "the entropy bonus' weight"),
    "ppo_mini_batch_size": ("verl", "train.mini_batches", "optimizer steps per training step"),
    "temperature": ("verl and TRL", "rollout.temperature", "the rollout's sampling temperature"),
    "output_dir": ("TRL", "log.run_dir", "where run folders are made"),
    "save_steps": ("TRL", "checkpoint.every", "steps between checkpoints"),
    "save_freq": ("verl", "checkpoint.every", "steps between checkpoints"),
}


def known_flags(cls: type) -> set[str]:
    """Every dotted flag of a config dataclass, with underscores (``rollout.max_new_tokens``)."""
    out: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints.get(f.name)):
            out |= {f"{f.name}.{name}" for name in known_flags(hints[f.name])}
        else:
            out.add(f.name)
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def foreign_flag_hint(argv: Iterable[str], known: set[str]) -> str | None:
    """The first argument that is not one of ``known`` but another system's name for one: one line."""
    for arg in argv:
        if not arg.startswith("--") or arg in ("--help",):
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        head, _, last = name.rpartition(".")
        if name in known or (last.startswith("no_") and f"{head}.{last[3:]}".lstrip(".") in known):
            continue
        parts = name.split(".")
        for i in range(len(parts)):
            hit = HINTS.get(".".join(parts[i:]))
            if hit is not None and hit[1] in known:
                who, ours, what = hit
                return f"{arg.split('=', 1)[0]} is {who}'s name for it: StaleFlow's is {_flag(ours)} ({what})"
    return None
