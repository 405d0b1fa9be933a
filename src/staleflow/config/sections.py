"""The config section of each component of the algorithm and the engines (model, rollout,
staleness, train, coordinator): a frozen dataclass each, validated in ``__post_init__`` with a
one-line ConfigError naming the flag. The job's inputs and outputs (reward, data, fault,
checkpoint, eval, log) are in config/job.py; RunConfig (config/run.py) composes them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from staleflow.config.ranges import in_range
from staleflow.config.speculative import SpeculativeConfig
from staleflow.faults import ConfigError  # the fault every layer raises for a bad value (re-exported)


def _check(ok: bool, flag: str, value, need: str) -> None:
    if not ok:
        raise ConfigError(f"--{flag}={value!r} is invalid: {need}")


def parse_length_dist(spec: str) -> tuple[float, float] | None:
    """'lognormal:MEDIAN:SIGMA' -> (median, sigma); None when malformed."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "lognormal":
        return None
    try:
        median, sigma = float(parts[1]), float(parts[2])
    except ValueError:
        return None
    return (median, sigma) if median > 0 and sigma >= 0 else None


@dataclass(frozen=True)
class ModelConfig:
    """Which policy model to train and how to run it."""

    path: str = "smollm2-135m"
    """Hugging Face model folder (config.json + safetensors) or an alias: smollm2-135m, tiny-llama, tiny-qwen2, tiny-qwen3, tiny-qwen3-moe."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter/compute dtype: auto = bfloat16 on CUDA, float32 on CPU."""

    def __post_init__(self):
        _check(bool(self.path), "model.path", self.path, "give a model folder or an alias such as smollm2-135m")


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout ranks and the engine each of them runs."""

    ranks: int = 2
    """Number of rollout ranks (the last ranks of the torchrun world); the others train."""
    engine: str = "builtin"
    """Rollout engine: a registered backend (builtin, pure PyTorch, the default; docs/extending.md lists
    them all) or 'package.module:Name', a fork's backend class (docs/extending.md)."""
    max_running: int = 64
    """Cap on concurrently running requests per instance."""
    max_kv_tokens: int = 65536
    """KV-cache capacity per instance, in tokens."""
    block_size: int = 16
    """Paged KV-cache block size, in tokens."""
    prefill_chunk_tokens: int = 2048
    """Token budget of one engine step for (chunked) prefill."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (the trainer computes log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top-p (1 disables)."""
    top_k: int = 0
    """0 disables top-k."""
    max_new_tokens: int = 256
    """Response length cap, in tokens (a response stopped there is truncated, not finished by eos)."""
    max_model_len: int = 2048
    """Longest sequence (prompt + response) an engine holds, in tokens; at most the model's max_position_embeddings."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Rollout engine dtype: auto = the trainer's --model.dtype. bfloat16 decodes ~2x faster on CPUs
    with AMX / AVX512-BF16 (docs/perf.md); the off-policy correction absorbs the rounding."""
    stats_interval_ms: float = 10.0
    """How often a rollout rank reports its stats to the controller."""
    length_dist: str = ""
    """Benchmark workload: 'lognormal:MEDIAN:SIGMA' draws each trajectory's length (capped at
    max-new-tokens, eos ignored): reasoning-RL length skew with any model. Empty: the model decides."""
    profile: bool = False
    """Record (n_running, kv_tokens, step latency) per engine step, for scripts/fit_cost_model.py (steps that
    verify speculative drafts are left out: the cost model is of one token a sequence)."""
    decode_backend: Literal["auto", "mirror", "gather", "triton", "flash"] = "auto"
    """Built-in engine decode attention (rollout/decode_backend.py; auto: flash-attn's block-table
    kernel on CUDA when it applies, else the Triton paged kernel; the dense decode mirror on CPU)."""
    prefix_sharing: bool = True
    """Share the KV blocks of identical prompt prefixes (a GRPO group's prompt is prefilled once)."""
    cuda_graphs: bool = False  # built-in engine, CUDA only: replay captured decode steps (docs/engine.md)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # config/speculative.py

    def __post_init__(self):
        in_range(self, "rollout")
        _check(self.ranks >= 1, "rollout.ranks", self.ranks, "need at least 1 rollout rank")
        _check(self.max_running >= 1, "rollout.max-running", self.max_running, "must be >= 1")
        _check(self.block_size >= 1, "rollout.block-size", self.block_size, "must be >= 1")
        _check(
            self.max_kv_tokens >= self.block_size,
            "rollout.max-kv-tokens",
            self.max_kv_tokens,
            "must hold at least one KV block",
        )
        _check(
            self.prefill_chunk_tokens >= 1, "rollout.prefill-chunk-tokens", self.prefill_chunk_tokens, "must be >= 1"
        )
        _check(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0 (use top-k 1 for greedy)")
        _check(0 < self.top_p <= 1, "rollout.top-p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "rollout.top-k", self.top_k, "must be >= 0 (0 disables)")
        _check(self.max_new_tokens >= 1, "rollout.max-new-tokens", self.max_new_tokens, "must be >= 1")
        _check(self.max_model_len > 1, "rollout.max-model-len", self.max_model_len, "must be > 1")
        _check(self.stats_interval_ms > 0, "rollout.stats-interval-ms", self.stats_interval_ms, "must be > 0")
        _check(
            self.length_dist == "" or parse_length_dist(self.length_dist) is not None,
            "rollout.length-dist",
            self.length_dist,
            "use 'lognormal:MEDIAN:SIGMA' with MEDIAN > 0 and SIGMA >= 0, or ''",
        )
        _check(
            not self.speculative.enabled or self.engine == "builtin",
            "rollout.speculative.draft-tokens",
            self.speculative.draft_tokens,
            f"speculative decoding is the built-in engine's (--rollout.engine is {self.engine!r}): drop it or use builtin",
        )


@dataclass(frozen=True)
class StalenessConfig:
    """The global staleness protocol: bound eta per trajectory, buffer capacity and redundancy."""

    eta: int = 1
    """Staleness bound: every trained trajectory has V_traj <= V_buf <= V_traj + eta."""
    batch_size: int = 8
    """B: prompt groups per staleness buffer (one training step)."""
    batch_redundancy: int = 0
    """B' - B: extra groups admitted per buffer; the surplus is aborted when the buffer is Ready."""
    group_size: int = 4
    """N: responses per prompt (GRPO group)."""
    group_redundancy: int = 0
    """N' - N: extra responses generated per prompt; the slowest are aborted."""
    straggler: Literal["off", "abort", "truncate"] = "off"
    """What to do with the last in-flight trajectories of a Stuck buffer."""
    straggler_threshold: int = 1
    """Act on a Stuck buffer once at most this many entries are still RESERVED."""
    train_order: Literal["completion", "drawn"] = "completion"
    """Which occupied groups the trainer gets (StaleFlow's protocol only; the peers' modes reject 'drawn'):
    completion = each buffer keeps the groups that completed first (greedy Occupy); drawn = when buffer v
    is consumed it is swapped with completed groups of later buffers that STARTED earlier, as far as every
    moved group stays within eta (AReaL's batch order inside the bound; docs/protocol.md "Train order")."""

    @property
    def batch_capacity(self) -> int:
        """B': groups admitted per buffer (B + redundancy)."""
        return self.batch_size + self.batch_redundancy

    @property
    def group_capacity(self) -> int:
        """N': responses generated per prompt (N + redundancy)."""
        return self.group_size + self.group_redundancy

    def __post_init__(self):
        _check(self.eta >= 0, "staleness.eta", self.eta, "must be >= 0 (0 = synchronous)")
        _check(self.batch_size >= 1, "staleness.batch-size", self.batch_size, "must be >= 1")
        _check(self.batch_redundancy >= 0, "staleness.batch-redundancy", self.batch_redundancy, "must be >= 0")
        _check(self.group_size >= 1, "staleness.group-size", self.group_size, "must be >= 1")
        _check(self.group_redundancy >= 0, "staleness.group-redundancy", self.group_redundancy, "must be >= 0")
        _check(self.straggler_threshold >= 1, "staleness.straggler-threshold", self.straggler_threshold, "must be >= 1")
        _check(
            self.train_order in ("completion", "drawn"),
            "staleness.train-order",
            self.train_order,
            "choose completion or drawn",
        )


@dataclass(frozen=True)
class TrainConfig:
    """Trainer: optimisation, advantage estimator, loss and off-policy correction."""

    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or cosine decay to 0 at the last step."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch."""
    advantage: str = "grpo"
    """Advantage estimator: grpo, grpo-nostd, dr-grpo, rloo, or 'package.module:name' (docs/extending.md)."""
    loss: str = "grpo"
    """Policy loss: grpo (PPO-clip; ppo is the same loss), gspo, or 'package.module:name' (docs/extending.md).
    DAPO is a recipe, not a loss of its own: --preset dapo (docs/recipes.md)."""
    loss_agg: Literal["auto", "token-mean", "seq-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "auto"
    """Loss aggregation (docs/trainer.md maps each to TRL / verl names): auto = the loss's paper
    (gspo -> seq-mean, --train.advantage dr-grpo -> seq-mean-token-sum-norm, else token-mean)."""
    clip_low: float = 0.2
    """PPO clip range below 1: the ratio is clipped at 1 - clip-low."""
    clip_high: float = 0.2
    """PPO clip range above 1: the ratio is clipped at 1 + clip-high (DAPO clip-higher: 0.28)."""
    off_policy: str = "tis-token"
    """Off-policy correction between behaviour (rollout) and current policy: none, tis-token, tis-seq,
    mis-token, mis-seq, mis-seq-geo, decoupled, or 'package.module:name' (docs/extending.md)."""
    is_cap: float = 2.0
    """Upper cap of truncated importance weights."""
    is_low: float = 0.5
    """Masked IS: lower bound of the accepted ratio."""
    is_high: float = 2.0
    """Masked IS: upper bound of the accepted ratio."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy (0: no reference model is kept)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator (Schulman's k1: log-ratio, k3: unbiased and non-negative)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0 disables)."""
    logprob_impl: Literal["auto", "chunked", "triton", "naive"] = "auto"
    """Packed log-prob op: auto = Triton on CUDA, chunked PyTorch elsewhere."""
    mini_batches: int = 1
    """Optimizer updates per Ready buffer (>1 makes the proximal policy differ from the current one)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal)."""
    dynamic_sampling_refill: int = 0
    """DAPO's refill: up to this many all-equal groups per step are replaced by fresh prompts before
    the batch is trained (needs --train.dynamic-sampling; 0: such groups are only dropped)."""
    overlong_max_tokens: int = 0
    """DAPO overlong shaping: response length where the penalty reaches -1 (0 disables)."""
    overlong_cache_tokens: int = 0
    """DAPO overlong shaping: length of the linear penalty ramp before overlong-max-tokens."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype over fp32 master weights: auto = bf16 on CUDA, fp32 on CPU (LM head always fp32 on CPU)."""
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    """Recompute each decoder layer in backward (less memory, ~30% more compute); auto: on for CUDA only."""
    router_aux_coef: float = 0.0
    """MoE models: weight of the router's load-balancing loss (Qwen3-MoE pre-trained with 0.001); 0: off (docs/trainer.md)."""

    def __post_init__(self):
        in_range(self, "train")
        _check(
            math.isfinite(self.lr) and 0 < self.lr <= 1,
            "train.lr",
            self.lr,
            "must be in (0, 1] (a step that large destroys the weights; typical RL values are 1e-7 to 1e-4)",
        )
        _check(self.weight_decay >= 0, "train.weight-decay", self.weight_decay, "must be >= 0")
        _check(self.warmup_steps >= 0, "train.warmup-steps", self.warmup_steps, "must be >= 0")
        _check(self.grad_clip >= 0, "train.grad-clip", self.grad_clip, "must be >= 0 (0 disables)")
        _check(self.micro_batch_tokens >= 1, "train.micro-batch-tokens", self.micro_batch_tokens, "must be >= 1")
        _check(self.clip_low >= 0, "train.clip-low", self.clip_low, "must be >= 0")
        _check(self.clip_high >= 0, "train.clip-high", self.clip_high, "must be >= 0")
        _check(self.is_cap >= 1, "train.is-cap", self.is_cap, "must be >= 1")
        _check(
            0 <= self.is_low <= 1 <= self.is_high,
            "train.is-low/is-high",
            (self.is_low, self.is_high),
            "need 0 <= is-low <= 1 <= is-high",
        )
        _check(
            self.loss != "dapo",
            "train.loss",
            self.loss,
            "DAPO's loss is PPO-clip with clip-higher and token-mean aggregation, not a loss of its own: use "
            "--preset dapo (the whole recipe) or --train.loss grpo --train.clip-high 0.28 --train.loss-agg token-mean",
        )
        _check(self.kl_coef >= 0, "train.kl-coef", self.kl_coef, "must be >= 0")
        _check(
            self.dynamic_sampling_refill >= 0 and (self.dynamic_sampling or not self.dynamic_sampling_refill),
            "train.dynamic-sampling-refill",
            self.dynamic_sampling_refill,
            "must be >= 0, and > 0 only with --train.dynamic-sampling",
        )
        _check(self.mini_batches >= 1, "train.mini-batches", self.mini_batches, "must be >= 1")
        _check(self.router_aux_coef >= 0, "train.router-aux-coef", self.router_aux_coef, "must be >= 0 (0 disables)")
        _check(self.overlong_max_tokens >= 0, "train.overlong-max-tokens", self.overlong_max_tokens, "must be >= 0")
        _check(
            0 <= self.overlong_cache_tokens <= max(self.overlong_max_tokens, 0),
            "train.overlong-cache-tokens",
            self.overlong_cache_tokens,
            "need 0 <= overlong-cache-tokens <= overlong-max-tokens",
        )


@dataclass(frozen=True)
class CoordinatorConfig:
    """The staleness-aware coordinator (Snapshot-Command cycle) and its strategies."""

    routing: str = "waterfall"
    """Routing strategy: waterfall, waterfall-budget, round-robin, least-loaded, or 'package.module:Class'
    (docs/extending.md)."""
    tiers: Literal["version", "reserve"] = "version"
    """Waterfall tiers: by instance version (older first) or by reserve indicator."""
    mu: float = 0.2
    """Accept a route only if its marginal gain >= mu * the gain on an empty instance."""
    mlq: bool = True
    """Multi-level queue by V_traj (oldest level first, strict)."""
    max_concurrent: int = 1024
    """Per-instance cap on running trajectories."""
    pull: str = "status"
    """Pull policy: status, greedy, idle, pause-all, or 'package.module:Class' (docs/extending.md)."""
    pull_indicator: Literal["requests", "kv", "throughput"] = "kv"
    """Load indicator the status pull compares with --coordinator.pull-threshold."""
    pull_threshold: float = 0.6
    """An instance pulls new weights only while its load indicator (a fraction of capacity) is under this."""
    migration: bool = True
    """Migrate trajectories between instances (interrupt and re-route) on a long queue or a throughput gap."""
    phi_wait: int = 3
    """Migrate when an instance's waiting queue exceeds this many trajectories."""
    psi: float = 5.0
    """Migrate when an instance's load indicator exceeds psi times a starved instance's (0: never)."""
    migration_stop: int = 2
    """Do not migrate off an instance with fewer running trajectories than this."""
    tick_ms: float = 10.0
    """Period of the coordinator's Snapshot-Command cycle, in milliseconds."""
    cost_model: str = "cpu-smollm2"
    """Cost-model coefficients: a preset name or a JSON file path."""
    longest_first: bool = True
    """Inside an MLQ level, route trajectories with more tokens first (else arrival order)."""
    new_order: Literal["longest", "drawn"] = "drawn"
    """Order of new prompts (the MLQ's untagged level) under --coordinator.longest-first: drawn, the data order
    (longest-first orders only the loop-backs), or longest: longest prompt first (the paper code's queue, which
    trains the data out of order: docs/perf.md, issue 41)."""
    migration_indicator: Literal["requests", "kv", "throughput"] = "requests"
    """Load indicator of the psi (throughput-gap) migration trigger."""
    interrupt_on_pull: bool = True
    """A Pull first interrupts the instance's in-flight trajectories (partial rollout: they loop back)."""
    keep_kv_on_pull: bool = False  # a Pull interrupts nothing: in-flight work keeps its KV, continues (docs/engine.md)
    barrier: bool = False
    """Batch barrier (sync / one-step-off): route a new batch of B groups only when nothing is in flight."""
    scan_limit: int = 32
    """Routing gives up on a level after this many consecutive trajectories found no instance (bounds tick cost)."""
    migration_cooldown_s: float = 5.0
    """An instance holding a trajectory migrated less than this many seconds ago is not migrated again (no ping-pong)."""
    tail_lanes: bool = False
    """Critical-path tail lanes: the trajectories holding back the oldest buffer decode on lightly loaded instances."""
    planners: tuple[str, ...] = ()
    """Extra planners run every tick after the built-in ones, in order: registered names or 'package.module:Class'
    (a class (cfg, cost_model) with plan(ctx, now) returning Route / Interrupt / Pull / Abort commands; docs/extending.md)."""

    def __post_init__(self):
        in_range(self, "coordinator")
        _check(self.scan_limit >= 1, "coordinator.scan-limit", self.scan_limit, "must be >= 1")
        _check(self.mu >= 0, "coordinator.mu", self.mu, "must be >= 0")
        _check(self.max_concurrent >= 1, "coordinator.max-concurrent", self.max_concurrent, "must be >= 1")
        _check(self.pull_threshold >= 0, "coordinator.pull-threshold", self.pull_threshold, "must be >= 0")
        _check(self.phi_wait >= 0, "coordinator.phi-wait", self.phi_wait, "must be >= 0")
        _check(self.psi > 1 or self.psi == 0, "coordinator.psi", self.psi, "must be > 1 (or 0: off)")
        _check(self.migration_stop >= 0, "coordinator.migration-stop", self.migration_stop, "must be >= 0")
        _check(self.tick_ms > 0, "coordinator.tick-ms", self.tick_ms, "must be > 0")


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn rollouts: the environment a trajectory talks to and its limits (docs/multi-turn.md)."""

    name: str = ""
    """Environment: '' (single-turn: one prompt, one response), a built-in (calculator, python) or
    'package.module:Class', a class (EnvConfig) with async reset(prompt) and step(message) (docs/multi-turn.md)."""
    max_turns: int = 4
    """Most model turns per trajectory; the trajectory ends after the last one whatever the model said."""
    max_total_tokens: int = 0
    """Most response tokens per trajectory, model and environment tokens together, the prompt excluded
    (0: as many as --rollout.max-model-len leaves after the prompt)."""
    max_turn_tokens: int = 0
    """Most new tokens the model generates in one turn (0: --rollout.max-new-tokens)."""
    max_observation_tokens: int = 256
    """Most tokens of one observation (tool turn and next assistant header); longer ones are cut with a marker."""
    step_timeout_s: float = 30.0
    """Seconds one environment step (its tool calls) may take; past it the model reads a timeout message."""
    tool_format: Literal["auto", "qwen", "llama3"] = "auto"
    """Tool-call syntax: qwen (<tool_call>{json}</tool_call>), llama3 ({"name", "parameters"} JSON or
    <|python_tag|>), auto: the one the chat template uses (qwen for templates without tool support)."""

    def __post_init__(self):
        in_range(self, "env")
        _check(self.max_turns >= 1, "env.max-turns", self.max_turns, "must be >= 1")
        _check(self.max_total_tokens >= 0, "env.max-total-tokens", self.max_total_tokens, "must be >= 0 (0: no cap)")
        _check(self.max_turn_tokens >= 0, "env.max-turn-tokens", self.max_turn_tokens, "must be >= 0 (0: rollout's)")
        _check(
            self.max_observation_tokens >= 32,
            "env.max-observation-tokens",
            self.max_observation_tokens,
            "must be >= 32 (the tool turn's framing and the truncation marker need room)",
        )
        _check(self.step_timeout_s > 0, "env.step-timeout-s", self.step_timeout_s, "must be > 0 seconds")
        _check(
            self.tool_format in ("auto", "qwen", "llama3"), "env.tool-format", self.tool_format, "auto, qwen or llama3"
        )
