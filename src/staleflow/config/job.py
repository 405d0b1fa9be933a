"""The config sections of the job's inputs and outputs: reward, data, fault handling,
checkpoints, held-out evaluation and logging (the algorithm's sections are in config/sections.py).
Each is a frozen dataclass validated in ``__post_init__`` with a one-line ConfigError."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from staleflow.config.sections import _check


@dataclass(frozen=True)
class RewardConfig:
    """Reward function and its worker pool (in the controller)."""

    fn: str = "arithmetic"
    """Registered name (arithmetic, math, countdown, code_tests: docs/sandbox.md) or a user function 'module:function'."""
    workers: int = 2
    """Reward worker processes in the controller (rewards are computed asynchronously)."""
    format_weight: float = 0.0
    """Bonus added to a correct answer given in \\boxed{} (never to a wrong one)."""
    timeout_s: float = 30.0
    """A reward call running longer than this is killed and scores 0 (its worker is restarted)."""
    max_consecutive_failures: int = 32
    """Stop the run after this many reward calls in a row failed (raised, timed out, returned a
    non-finite or non-number value); 0 never stops. Every failure is counted in metrics.jsonl."""
    model: str = ""
    """A learned reward: a Hugging Face sequence-classification folder (safetensors, one label) that
    scores (prompt, response) in processes of its own ('' : none; docs/data-and-rewards.md)."""
    model_weight: float = 1.0
    """Weight of the reward model's score in the reward (with --reward.model)."""
    rule_weight: float = 1.0
    """Weight of --reward.fn's reward next to the reward model's; 0 with --reward.model: the model alone."""
    model_device: str = "cpu"
    """Where the reward model runs: cpu or cuda:N (a trainer rank's GPU only with --reward.model-share-trainer-gpu)."""
    model_share_trainer_gpu: bool = False
    """Allow --reward.model-device to be a GPU a trainer rank uses (their memory plans then share it)."""
    model_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Reward model dtype: auto = bfloat16 on CUDA, float32 on CPU."""
    model_batch_size: int = 16
    """Responses scored in one forward of the reward model (fewer when fewer are waiting)."""
    model_max_tokens: int = 4096
    """Longest (prompt + response) the reward model reads; longer ones lose their beginning (the
    response's end is kept: a sequence classifier scores the last token)."""
    model_workers: int = 1
    """Reward-model processes (each loads its own copy on --reward.model-device)."""

    def __post_init__(self):
        _check(bool(self.fn), "reward.fn", self.fn, "give a registered name or module:function")
        _check(self.workers >= 1, "reward.workers", self.workers, "must be >= 1")
        _check(
            self.format_weight >= 0,
            "reward.format-weight",
            self.format_weight,
            "must be >= 0 (a bonus for a correct boxed answer)",
        )
        _check(self.timeout_s > 0, "reward.timeout-s", self.timeout_s, "must be > 0")
        _check(
            self.max_consecutive_failures >= 0,
            "reward.max-consecutive-failures",
            self.max_consecutive_failures,
            "must be >= 0 (0 never stops)",
        )
        _check(self.model_weight >= 0, "reward.model-weight", self.model_weight, "must be >= 0")
        _check(self.rule_weight >= 0, "reward.rule-weight", self.rule_weight, "must be >= 0")
        _check(
            not self.model or self.model_weight + self.rule_weight > 0,
            "reward.model-weight",
            self.model_weight,
            "--reward.model-weight and --reward.rule-weight cannot both be 0",
        )
        _check(
            self.model_device == "cpu" or re.fullmatch(r"cuda:\d{1,3}", self.model_device) is not None,
            "reward.model-device",
            self.model_device,
            "use cpu or cuda:N (a GPU index)",
        )
        _check(self.model_batch_size >= 1, "reward.model-batch-size", self.model_batch_size, "must be >= 1")
        _check(self.model_max_tokens >= 2, "reward.model-max-tokens", self.model_max_tokens, "must be >= 2")
        _check(self.model_workers >= 1, "reward.model-workers", self.model_workers, "must be >= 1")


def parse_mix(spec: str) -> tuple[tuple[str, float], ...] | None:
    """'a.parquet:0.7,b:0.3' -> (('a.parquet', 0.7), ('b', 0.3)); None when malformed. The weight is
    after the last ':' of each item, so a task function 'pkg.mod:fn:0.5' keeps its own colon."""
    out = []
    for item in spec.split(","):
        name, sep, weight = item.strip().rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            return None
        if not sep or not name or not (w > 0 and math.isfinite(w)):
            return None
        out.append((name, w))
    return tuple(out) if out else None


@dataclass(frozen=True)
class DataConfig:
    """Prompt source: a built-in task, a data file, a save_to_disk folder or a cached Hugging Face dataset
    (docs/data-and-rewards.md)."""

    source: str = "arithmetic"
    """Built-in task (arithmetic, arithmetic-easy, countdown, word-steps), a .jsonl / .parquet / .json file, a folder
    written by datasets' save_to_disk, a Hugging Face dataset name in the local cache, or a task function
    'package.module:name' (docs/extending.md)."""
    mix: str = ""
    """Several sources with weights, 'a.parquet:0.7,b.jsonl:0.3' (replaces --data.source; each prompt
    is drawn from a source with probability weight / sum; held-out evaluation is reported per source)."""
    split: str = "train"
    """Split of a save_to_disk DatasetDict or a Hugging Face dataset."""
    subset: str = ""
    """Configuration (subset) name of a Hugging Face dataset ('' : its default)."""
    prompt_field: str = "prompt"
    """Field holding the prompt: a string or a list of chat messages; a dotted path reaches into nested
    records (e.g. extra_info.question)."""
    answer_field: str = "auto"
    """Field holding the reference answer (dotted paths allowed); auto: the first of answer,
    reward_model.ground_truth (verl), solution, ground_truth."""
    system_prompt: str = ""
    """System message put before each string prompt (chat-message prompts keep their own)."""
    prompt_template: str = ""
    """Template for string prompts with '{prompt}' where the row's prompt goes, e.g. '{prompt} Put the
    final answer in \\boxed{}.' ('' : the prompt as is)."""
    bad_rows: Literal["skip", "error"] = "skip"
    """Bad rows are always reported with their row number; then skipped or the run stops."""
    max_prompt_tokens: int = 512
    """Prompts longer than this many tokens (after the chat template) are bad rows."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template (a chat-message prompt needs it)."""
    seed: int = 0
    """Seed of the data order, the held-out choice and the mix draws."""

    def __post_init__(self):
        _check(
            bool(self.source), "data.source", self.source, "give a built-in task name, a file or package.module:name"
        )
        _check(self.max_prompt_tokens >= 1, "data.max-prompt-tokens", self.max_prompt_tokens, "must be >= 1")
        _check(
            not self.mix or parse_mix(self.mix) is not None,
            "data.mix",
            self.mix,
            "use 'SOURCE:WEIGHT,SOURCE:WEIGHT' with weights > 0, e.g. 'a.parquet:0.7,b.jsonl:0.3'",
        )
        _check(
            not self.prompt_template or "{prompt}" in self.prompt_template,
            "data.prompt-template",
            self.prompt_template,
            "must contain {prompt} where the row's prompt goes",
        )
        _check(bool(self.prompt_field), "data.prompt-field", self.prompt_field, "give a field name")
        _check(bool(self.answer_field), "data.answer-field", self.answer_field, "give a field name or auto")

    @property
    def sources(self) -> tuple[tuple[str, float], ...]:
        """(source, weight) of every source: --data.mix, else --data.source with weight 1."""
        return parse_mix(self.mix) if self.mix else ((self.source, 1.0),)


@dataclass(frozen=True)
class FaultConfig:
    """Stuck ranks: a rank that sends nothing, or has work and makes no progress, for the stall
    limit is named in one line and the run restarts from its newest checkpoint."""

    stall_s: float = 0.0
    """The stall limit in seconds; 0: sized from the run, max(stall-floor-s, 4 x its longest step)."""
    stall_floor_s: float = 300.0
    """The smallest automatic stall limit (model loads, a first step on a busy machine)."""
    remote_lost_s: float = 3.0
    """A rank on another node whose connection to the controller stays down this long is dead (its process or
    its node is gone): raise it on a network that drops connections for longer and recovers. The hub heart-beats
    every second (so under ~1 s means one missed beat), and a rank lost this long delays the emergency checkpoint
    by as much: keep it well under torchrun's own timeouts."""

    def __post_init__(self):
        _check(self.stall_s >= 0, "fault.stall-s", self.stall_s, "must be >= 0 (0: automatic)")
        _check(self.stall_floor_s > 0, "fault.stall-floor-s", self.stall_floor_s, "must be > 0")
        _check(1.0 <= self.remote_lost_s <= 600, "fault.remote-lost-s", self.remote_lost_s, "must be in [1, 600] s")

    def limit(self, longest_step_s: float) -> float:
        """The stall limit now, given the longest training step so far (0 before the first)."""
        return self.stall_s or max(self.stall_floor_s, 4.0 * longest_step_s)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 5
    """Save the full training state every this many steps (0: only at the end and on a stop).
    A crash or a restart then repeats at most every-1 steps (their rows are marked superseded)."""
    keep: int = 2
    """Keep the last K training-state checkpoints."""
    export_hf: bool = True
    """Export the final policy as a Hugging Face safetensors folder."""
    async_save: bool = True
    """Write periodic checkpoints in the background while training goes on (False: training waits
    for each; the final one and one before a stop are always waited for)."""

    def __post_init__(self):
        _check(self.every >= 0, "checkpoint.every", self.every, "must be >= 0")
        _check(self.keep >= 1, "checkpoint.keep", self.keep, "must be >= 1")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: greedy answers to prompts never used for training, on the rollout ranks."""

    n: int = 0
    """Held-out prompts per evaluation (0: no evaluation). They are set aside from the data
    before training starts and never trained on."""
    every: int = 10
    """Evaluate every this many steps, besides at step 0 and at the end (0: only those two)."""
    max_new_tokens: int = 0
    """Answer length cap (0: --rollout.max-new-tokens)."""

    def __post_init__(self):
        _check(self.n >= 0, "eval.n", self.n, "must be >= 0 (0 disables evaluation)")
        _check(self.every >= 0, "eval.every", self.every, "must be >= 0 (0: only at the start and the end)")
        _check(self.max_new_tokens >= 0, "eval.max-new-tokens", self.max_new_tokens, "must be >= 0")


@dataclass(frozen=True)
class LogConfig:
    run_dir: str = "runs"
    """Parent folder of run folders."""
    name: str = ""
    """Run folder name (default: a timestamp)."""
    progress: bool = True
    """A progress bar on a terminal (the per-step lines are printed either way)."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run folder (tb/)."""
    plot: bool = True
    """Write report.png (reward, staleness and throughput over the steps) at the end of the run."""
    wandb: bool = False
    """Also log to Weights & Biases (extra staleflow[wandb]; WANDB_MODE=offline works without an account)."""
    wandb_project: str = "staleflow"
    """Weights & Biases project name (with --log.wandb)."""
