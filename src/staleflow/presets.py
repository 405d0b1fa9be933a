"""Run presets (``--preset NAME``): plain functions returning a RunConfig, registered in PRESETS.

smollm2-cpu   the embedded default: SmolLM2-135M-Instruct, arithmetic, 1 trainer + 2 rollout on CPU
smollm2-cpu-calc   the same task with a calculator tool: multi-turn, tool-using trajectories (--env.name)
tiny          a tiny random Llama for tests and quick checks (seconds per step on CPU)
gpu-7b        Qwen2.5-7B-Instruct on one 8-GPU node (80 GB each): 4 trainer + 4 rollout ranks
gpu-7b-python the same node, math with a sandboxed Python tool (multi-turn; documented, not run on CPU)

Recipes (``--preset dapo``, ``--preset gpu-7b+dapo``): an algorithm's flags from its paper put over
a machine preset (smollm2-cpu when none is named): dapo, grpo, dr-grpo, gspo (presets_recipes.py,
docs/recipes.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from staleflow.config import (
    CheckpointConfig,
    CoordinatorConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    StalenessConfig,
    TrainConfig,
)
from staleflow.presets_recipes import RECIPES


def preset_smollm2_cpu() -> RunConfig:
    """The embedded default: SmolLM2-135M-Instruct learns easy arithmetic on 2 CPU cores in minutes.

    Chosen from measurements (docs/perf.md, "Default recipe" and issue 24's section): on
    `arithmetic-easy` the model is right ~40% of the time greedily and ~23% when sampling at
    temperature 0.7 (at 1.0: 5%, too few correct samples for a learning signal); responses up to
    64 tokens (its answers are short); eta 1. The reward is the answer check plus 0.5 when the
    right answer is in \\boxed{}. 4 prompts x 8 responses per step with DAPO dynamic sampling:
    groups whose answers are all right or all wrong carry no GRPO signal and are not computed
    (about half of them once the policy sharpens), so a step costs the trainer about what 2 prompts
    without the filter did while its gradient averages twice the prompts; lr 2e-5 decayed by a
    cosine to 0 at the last step, so late steps stop moving a policy that has sharpened (the
    constant-lr 2-prompt recipe undid its own gains in 2 of 2 runs: 0.41 -> 0.27 and 0.47 -> 0.39).
    128 held-out prompts, evaluated at steps 0, 10 and 20 with their 95% interval.
    """
    return RunConfig(
        rollout=RolloutConfig(max_new_tokens=64, max_model_len=512, max_kv_tokens=32768, temperature=0.7),
        train=TrainConfig(lr=2e-5, micro_batch_tokens=2048, schedule="cosine", dynamic_sampling=True),
        staleness=StalenessConfig(eta=1, batch_size=4, group_size=8),
        reward=RewardConfig(fn="arithmetic", format_weight=0.5),
        data=DataConfig(source="arithmetic-easy"),
        eval=EvalConfig(n=128, every=10),
        steps=20,
    )


def preset_smollm2_cpu_calc() -> RunConfig:
    """smollm2-cpu with the calculator tool (issue 40's CPU example): each trajectory is up to 3 turns;
    a turn with a ``<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call>``
    gets the result back as a tool turn (an observation, masked out of the loss), a turn without one
    ends it and is scored. The prompts show the tool's schema (SmolLM2's chat template has no tool
    support: the documented system-prompt fallback, docs/multi-turn.md). Up to 64 tokens per turn, 256
    per trajectory; tool steps time out after 10 s. Same data, reward, steps and held-out set as
    smollm2-cpu, so the two runs compare (held-out answers use the tool too).
    """
    env = EnvConfig(name="calculator", max_turns=3, max_turn_tokens=64, max_total_tokens=256, step_timeout_s=10.0)
    return replace(preset_smollm2_cpu(), env=env)


def preset_tiny() -> RunConfig:
    """A tiny random Llama for tests and quick checks (seconds per step on CPU)."""
    return RunConfig(
        model=ModelConfig(path="tiny-llama"),
        rollout=RolloutConfig(max_new_tokens=16, max_model_len=256, max_kv_tokens=8192),
        train=TrainConfig(lr=1e-3, micro_batch_tokens=1024),
        staleness=StalenessConfig(eta=1, batch_size=4, group_size=4),
        steps=4,
    )


def preset_gpu_7b() -> RunConfig:
    """Qwen2.5-7B-Instruct on one node of 8 GPUs with 80 GB each: 4 trainer ranks (FSDP2, fp32
    master weights, bf16 compute, activation checkpointing) and 4 rollout ranks (built-in engine
    in bf16, Triton paged decode). Launch with the model folder:

        python -m staleflow.launch.torchrun --standalone --nproc_per_node=8 -m staleflow train --preset gpu-7b \\
            --model.path /models/Qwen2.5-7B-Instruct

    Sized by the memory plan (``python -m staleflow plan --preset gpu-7b --gpu-memory-gib 80``,
    docs/memory-plan.md): 8k-token trajectories (1k prompt + 7k response), 896k KV tokens per
    rollout GPU (~112 full-length sequences), 16k-token micro-batches; the coordinator's cost
    model is an unmeasured H100 rescaling of PSRL's Qwen2.5-7B fit (re-fit it on the node).
    Math answers are checked with math-verify (``--reward.fn math``: a \\boxed{} answer, LaTeX or
    numbers); DAPO's dynamic sampling drops groups whose answers are all right or all wrong; 256
    held-out prompts are answered greedily every 10 steps. Bring the data with --data.source (a verl
    parquet, a save_to_disk folder, a cached hub dataset: docs/data-and-rewards.md).
    """
    return RunConfig(
        model=ModelConfig(path="Qwen/Qwen2.5-7B-Instruct"),
        rollout=RolloutConfig(
            ranks=4,
            max_running=128,
            max_kv_tokens=917504,
            prefill_chunk_tokens=8192,
            max_new_tokens=7168,
            max_model_len=8192,
            stats_interval_ms=50.0,
        ),
        train=TrainConfig(lr=1e-6, micro_batch_tokens=16384, warmup_steps=10, dynamic_sampling=True),
        staleness=StalenessConfig(eta=1, batch_size=32, group_size=8),
        coordinator=CoordinatorConfig(cost_model="gpu-7b-h100"),
        reward=RewardConfig(fn="math"),
        data=DataConfig(max_prompt_tokens=1024),
        checkpoint=CheckpointConfig(every=10),
        eval=EvalConfig(n=256, every=10),
        steps=200,
    )


def preset_gpu_7b_python() -> RunConfig:
    """gpu-7b with the ``python`` tool (issue 40's GPU recipe, not run on the CPU machines): the model
    may run Python in the sandbox (staleflow.sandbox: no network, CPU/memory/process/output limits)
    between its turns, up to 4 turns of at most 2048 tokens, 7168 response tokens in all (tool output
    included, each observation at most 1024 tokens), 30 s per tool step. Qwen2.5's chat template
    renders the tool schema itself and its ``<tool_call>`` format is parsed (--env.tool-format auto).
    Launch as gpu-7b, with ``--preset gpu-7b-python``; ``staleflow check`` refuses in one line when
    the sandbox cannot start on the node.
    """
    env = EnvConfig(
        name="python",
        max_turns=4,
        max_turn_tokens=2048,
        max_total_tokens=7168,
        max_observation_tokens=1024,
        step_timeout_s=30.0,
    )
    return replace(preset_gpu_7b(), env=env)


MACHINES: dict[str, Callable[[], RunConfig]] = {
    "smollm2-cpu": preset_smollm2_cpu,
    "smollm2-cpu-calc": preset_smollm2_cpu_calc,
    "tiny": preset_tiny,
    "gpu-7b": preset_gpu_7b,
    "gpu-7b-python": preset_gpu_7b_python,
}
"""The machine presets: model, ranks, lengths and sizes (a recipe is put over one of them)."""


class Presets(dict):
    """The machine presets and the recipes (each over smollm2-cpu); ``MACHINE+RECIPE`` composes any
    machine preset with recipes, e.g. ``gpu-7b+dapo``."""

    def _compose(self, name: str) -> Callable[[], RunConfig] | None:
        base, *recipes = name.split("+")
        if base in RECIPES:
            base, recipes = "smollm2-cpu", [base, *recipes]
        if base not in MACHINES or not recipes or any(r not in RECIPES for r in recipes):
            return None

        def build() -> RunConfig:
            cfg = MACHINES[base]()
            for r in recipes:
                cfg = RECIPES[r].apply(cfg)
            return cfg

        return build

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or (isinstance(name, str) and self._compose(name) is not None)

    def __missing__(self, name):
        fn = self._compose(name) if isinstance(name, str) else None
        if fn is None:
            raise KeyError(name)
        return fn


PRESETS: dict[str, Callable[[], RunConfig]] = Presets(MACHINES)
for _name in RECIPES:
    PRESETS[_name] = PRESETS[f"smollm2-cpu+{_name}"]
