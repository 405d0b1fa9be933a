"""``python -m staleflow eval``: the accuracy of a policy on a task, with its 95% interval.

    python -m staleflow eval --model.path runs/<run>/hf --data.source arithmetic-easy --n 256
    python -m staleflow eval --model.path smollm2-135m --data.source qa.jsonl --reward.fn math --samples 8 \\
        --rollout.temperature 0.7

The flags that name what ``staleflow train`` also has use train's names (--model.path, --data.*,
--reward.fn, --rollout.temperature / top-p / max-new-tokens); ``--config FILE`` reads flags from a
YAML or TOML file (config/file.py). --model.path is a Hugging Face folder, an alias (smollm2-135m, tiny-llama, ...) or a run folder (its
exported policy, RUN/hf). Prompts: the held-out prompts of a built-in task (the same ones a run
with the same --data.seed and --eval.n sets aside and never trains on; --n is required), or the
first --n rows of a data source (file, save_to_disk folder, cached hub dataset) (default: all). Answers come from the project's own
engine (the built-in rollout engine), greedy or --samples K per prompt; a completion is correct
when the reward function (--reward.fn) gives it full credit. Progress goes to stderr; the last
line on stdout is one JSON object: accuracy, ci95_low, ci95_high, ci_method (Wilson for greedy,
a bootstrap over prompts for K samples), n, pass_at_k (sampled), model, data, and the settings.
A bad flag, a missing or broken model folder, a missing file or a bad row (--data.bad-rows error,
the default here) is one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from staleflow.config import ConfigError, DataConfig, _check
from staleflow.data.tasks import TASKS


@dataclass(frozen=True)
class EvalReward:
    fn: str = "arithmetic"
    """Registered reward (arithmetic, math, countdown) or 'module:function'; correct = full credit (>= 1)."""


@dataclass(frozen=True)
class EvalModel:
    path: str = "smollm2-135m"
    """Hugging Face model folder, alias (smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3) or run folder (RUN/hf)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Engine dtype: auto = bfloat16 on CUDA, float32 on CPU."""


@dataclass(frozen=True)
class EvalRollout:
    """The engine's sampling and size, under the names ``staleflow train`` gives them."""

    temperature: float = 1.0
    """Sampling temperature (with --samples K)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (with --samples K; 1 disables)."""
    max_new_tokens: int = 256
    """Answer length cap, in tokens."""
    max_running: int = 64
    """Answers decoded at once by the engine."""
    max_kv_tokens: int = 32768
    """KV-cache capacity of the engine, in tokens."""
    engine: str = "builtin"
    """Rollout engine, as ``staleflow train`` takes it: a registered backend (builtin, vllm) or a
    fork's ``pkg.module:Name`` (docs/extending.md); the same backend builds it."""

    def __post_init__(self):
        _check(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0 (greedy: leave --samples 0)")
        _check(0 < self.top_p <= 1, "rollout.top-p", self.top_p, "must be in (0, 1]")
        _check(self.max_new_tokens >= 1, "rollout.max-new-tokens", self.max_new_tokens, "must be >= 1")
        _check(self.max_running >= 1, "rollout.max-running", self.max_running, "must be >= 1")


RENAMED = {
    "--model": "--model.path",
    "--dtype": "--model.dtype",
    "--temperature": "--rollout.temperature",
    "--top-p": "--rollout.top-p",
    "--max-new-tokens": "--rollout.max-new-tokens",
    "--max-running": "--rollout.max-running",
    "--max-kv-tokens": "--rollout.max-kv-tokens",
}
"""eval's flags before they took train's names: each is refused in one line naming its new name."""


@dataclass(frozen=True)
class EvalCommand:
    """Evaluate a policy on a task: accuracy with a 95% interval, as one JSON line."""

    model: EvalModel = field(default_factory=EvalModel)
    data: DataConfig = field(default_factory=lambda: DataConfig(source="arithmetic-easy", bad_rows="error"))
    reward: EvalReward = field(default_factory=EvalReward)
    rollout: EvalRollout = field(default_factory=EvalRollout)
    n: int = 0
    """Prompts: the first N rows of a file (0: all of them); N held-out prompts of a built-in task (required)."""
    samples: int = 0
    """0: one greedy answer per prompt. K >= 1: K sampled answers per prompt (mean accuracy and pass@K)."""
    seed: int = 0
    """Sampling seed (answer j of prompt i samples with seed + i * K + j)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs: auto = CUDA when torch sees a device, else CPU."""
    threads: int = 0
    """CPU threads of the engine (0: torch's default, one per core)."""
    progress: bool = True
    """Progress bar on stderr."""
    out: str = ""
    """Also write one JSON line per prompt (prompt, answer, correct per sample, first completion) to this file."""

    def __post_init__(self):
        _check(self.n >= 0, "n", self.n, "must be >= 0 (0: every row of a file)")
        _check(self.samples >= 0, "samples", self.samples, "must be >= 0 (0: greedy)")
        _check(self.threads >= 0, "threads", self.threads, "must be >= 0 (0: torch's default)")


def model_folder(spec: str) -> str:
    """--model.path -> an existing HF folder: a run folder's exported policy, a folder, or an alias."""
    from staleflow.model.hf import ModelLoadError
    from staleflow.model.loader import resolve_model_path

    path = Path(spec).expanduser()
    if (path / "hf").is_dir():
        return str(path / "hf")
    if path.is_dir() and (path / "metrics.jsonl").is_file() and not (path / "model.safetensors").exists():
        raise ModelLoadError(
            f"--model.path={spec!r} is a run folder without an exported policy (no hf/ inside): the run "
            f"has not finished, or ran with --checkpoint.no-export-hf"
        )
    return resolve_model_path(spec)


def load_prompts(cfg: EvalCommand, tokenizer) -> tuple[list, int]:
    """(the prompts to evaluate, bad rows skipped): see the module docstring."""
    from staleflow.data import Prompt, PromptSource
    from staleflow.reward.functions import answer_problem

    if cfg.data.source in TASKS and not cfg.n:
        raise ConfigError(f"--data.source={cfg.data.source!r} is a built-in task (endless): give --n, e.g. --n 256")
    source = PromptSource(cfg.data, tokenizer, answer_check=lambda a, meta: answer_problem(cfg.reward.fn, a, meta))
    if source.task is not None:
        return source.hold_out(cfg.n), 0
    rows = source.rows[: cfg.n] if cfg.n else source.rows
    ids = source.encode([r.messages or r.text for r in rows])
    return [Prompt(i, r.text, r.answer, pid, r.meta) for i, (r, pid) in enumerate(zip(rows, ids))], len(source.bad_rows)


EVAL_GPU_SHARE = 0.9
"""The GPU share an engine that preallocates one (takes_gpu_share: vLLM) gets when eval runs alone."""


def build_engine(cfg: EvalCommand, folder: str, max_prompt: int):
    """The --rollout.engine backend's engine on --device, sized for the longest prompt plus the answer
    cap: built as a rollout rank builds it (engines/backend.py), the policy loaded by eval when the
    backend wants the rank to load it."""
    from types import SimpleNamespace

    import torch

    from staleflow.config import ModelConfig, RolloutConfig, RunConfig
    from staleflow.engines import engine_backend
    from staleflow.rollout.builtin_engine import load_rollout_model

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    r = cfg.rollout
    max_len = max_prompt + r.max_new_tokens + 1
    rollout = RolloutConfig(
        max_running=r.max_running,
        max_kv_tokens=max(r.max_kv_tokens, max_len + 16),
        max_new_tokens=r.max_new_tokens,
        max_model_len=max_len,
        dtype=cfg.model.dtype,
        engine=r.engine,
    )
    run = RunConfig(model=ModelConfig(path=folder, dtype=cfg.model.dtype), rollout=rollout, seed=cfg.seed)
    backend = engine_backend(run)
    model = load_rollout_model(run.model, rollout, device) if backend.rank_loads_model else None
    share = EVAL_GPU_SHARE if device == "cuda" and backend.takes_gpu_share else None
    return backend.build(SimpleNamespace(cfg=run, rank=0, device=device, role="rollout"), model, share)


def run(cfg: EvalCommand) -> dict:
    """Evaluate; returns the JSON summary (also writes --out)."""
    from staleflow.eval.runner import generate, score_answers
    from staleflow.model import load_tokenizer
    from staleflow.model.args import ModelConfigError
    from staleflow.model.hf import ModelLoadError
    from staleflow.reward.functions import resolve_reward_fn
    from staleflow.rollout.engine import EngineError, SamplingParams

    t0 = time.monotonic()
    fn = resolve_reward_fn(cfg.reward.fn)
    folder = model_folder(cfg.model.path)
    try:
        tokenizer = load_tokenizer(folder)
    except ModelLoadError:
        raise
    except Exception as e:  # a corrupt tokenizer.json: one line, not a traceback
        raise ModelLoadError(f"cannot load the tokenizer in {folder!r}: {type(e).__name__}: {e}") from None
    prompts, skipped = load_prompts(cfg, tokenizer)
    try:
        engine = build_engine(cfg, folder, max(len(p.prompt_ids) for p in prompts))
    except (ConfigError, ModelLoadError, ModelConfigError, EngineError):
        raise
    except Exception as e:  # a corrupt safetensors file, an unreadable tensor: one line, not a traceback
        raise ModelLoadError(f"cannot load the model in {folder!r}: {type(e).__name__}: {e}") from None
    greedy = cfg.samples == 0
    params = SamplingParams(
        temperature=0.0 if greedy else cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.seed,
    )
    total = len(prompts) * max(1, cfg.samples)
    with _Progress(total, cfg.progress) as bar:
        answers = generate(engine, prompts, max(1, cfg.samples), params, on_finished=bar.update)
    summary, rows = score_answers(answers, prompts, fn, tokenizer)
    if cfg.out:
        with open(cfg.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    lengths = [len(a) for per in answers for a in per]
    return {
        **summary,
        "model": cfg.model.path,
        "model_folder": folder,
        "data": cfg.data.source,
        "data_seed": cfg.data.seed,
        "reward_fn": cfg.reward.fn,
        "mode": "greedy" if greedy else "sampled",
        "temperature": None if greedy else cfg.rollout.temperature,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "response_len_mean": sum(lengths) / len(lengths),
        "bad_rows_skipped": skipped,
        "engine": cfg.rollout.engine,
        "device": _device(engine, cfg),
        "wall_s": time.monotonic() - t0,
    }


def _device(engine, cfg: EvalCommand) -> str:
    """Where the engine's policy lives (an engine without a local model: what --device resolved to)."""
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "parameters"):
        return str(next(model.parameters()).device)
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device


class _Progress:
    """A rich progress bar on stderr (a terminal), else a line every 10% of the answers."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self._bar, self._next = total, enabled, None, 0.1

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(file=sys.stderr)
            if console.is_terminal:
                self._bar = Progress(
                    TextColumn("[bold]eval"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), console=console
                )
                self._task = self._bar.add_task("eval", total=self.total)
                self._bar.start()
        return self

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
        elif done >= self._next * self.total or done == self.total:
            print(f"eval: {done}/{self.total} answers", file=sys.stderr, flush=True)
            self._next = done / self.total + 0.1

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()


def parse_eval(argv: list[str]) -> EvalCommand:
    """EvalCommand from argv (with --config FILE of the same flags; command-line flags win)."""
    from staleflow.config.parse import parse

    return parse(EvalCommand, argv, {"eval": EvalCommand}, "eval", prog="staleflow eval", about=__doc__)


def main(argv: list[str]) -> int:
    from staleflow.data import DataError
    from staleflow.model.aliases import AliasError
    from staleflow.model.args import ModelConfigError
    from staleflow.model.hf import ModelLoadError
    from staleflow.reward.functions import RewardError
    from staleflow.rollout.engine import EngineError

    for arg in argv:
        old = arg.split("=", 1)[0]
        if old in RENAMED:
            print(
                f"staleflow eval: {old} is now {RENAMED[old]} (the name staleflow train gives it): use {RENAMED[old]}",
                file=sys.stderr,
                flush=True,
            )
            return 2
    cfg = parse_eval(argv)
    try:
        result = run(cfg)
    except (DataError, AliasError, ModelLoadError, ModelConfigError, RewardError, EngineError) as e:
        print(f"staleflow eval: {e}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(result), flush=True)
    return 0
