"""Configuration of the discrete-event simulator (``python -m staleflow sim``).

Every modelling assumption is a named field with its default and where the number comes from
(docs/simulator.md explains the model). Rates, transfer times and the KV capacity left at None
are derived from the model's size and the GPU (sim/hardware.py). Presets are functions in
PRESETS: ``paper-32b`` (128 H20 GPUs, Qwen2.5-32B TP2 cost model, GRPO group 8, responses up to
20k tokens, eta in {1, 2, 3}) and ``cpu-small`` (the default CPU job's shape: 1 trainer + 2
rollout ranks). ``--grid paper`` runs the evaluation grid (sim/grid.py) instead of one setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from staleflow.config import ConfigError, CoordinatorConfig, StalenessConfig, _check
from staleflow.modes import MODES, PeerSettings, check_mode, peers
from staleflow.sim.lengths import LENGTH_DISTS

DEFAULT_MODES = (*(m.name for m in peers()), "staleflow")
"""Every registered peer (registration order), then StaleFlow."""


@dataclass(frozen=True)
class SimConfig:
    """Discrete-event simulation of StaleFlow and its baselines on one workload."""

    # ---- cluster -----------------------------------------------------------------------------
    total_gpus: int = 128
    """GPUs of the whole job; every mode gets the same number (paper: 128 H20)."""
    rollout_gpus: int = 64
    """Disaggregated modes: GPUs running rollout instances (the rest train). sync uses all for both."""
    gpus_per_instance: int = 2
    """Tensor-parallel size of one rollout instance (the cost-model preset's TP)."""
    cost_model: str = "qwen2.5-32b-tp2"
    """Decode cost model of one instance: preset name or JSON file (staleflow.coordinator.cost_model)."""
    hardware: Literal["h20", "h100", "h200"] = "h20"
    """GPU profile (sim/hardware.PROFILES, sources in docs/simulator.md): its memory, bf16 peak and HBM bandwidth
    give the KV capacity, prefill/train rates and the decode cost model (the H20 fit rescaled, or a preset
    fitted on that GPU: scripts/fit_cost_model.py --profile). h20: the paper's cluster, the fit's own."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU (None: the profile's; H20 96 GB); with the model spec it gives the KV capacity."""
    gpu_tflops: float | None = None
    """Dense bf16 peak of one GPU (None: the profile's; H20 148 TFLOP/s); it gives prefill/train rates."""
    kv_capacity: int | None = None
    """KV-cache tokens per instance. None: derived (GPU memory x 0.9 - weights - 4 GB) / KV bytes per
    token (sim/hardware.py); for a cost model without a known architecture, the cost-model file's value."""
    prefill_tokens_per_s: float | None = None
    """Prefill (and KV recompute after an interrupt) rate of one instance. None: TP x peak x 40% MFU /
    (2 x params) (32B TP2 on H20: ~1.8k tokens/s)."""
    prefill_chunk_tokens: int = 8192
    """Chunked prefill: tokens per engine step shared by decode and prefill chunks (vLLM's
    max_num_batched_tokens; verl's rollout default 8192): decoding goes on while new work prefills. 0: a
    prefill (or a KV recompute) stops the instance's decoding until it is done."""
    max_running: int = 256
    """Engine cap on running sequences per instance (vLLM max_num_seqs default)."""
    # ---- trainer and weights -----------------------------------------------------------------
    train_tokens_per_gpu_s: float | None = None
    """Training throughput per trainer GPU, tokens/s (fwd+bwd+log-prob recompute). None: peak x 35% MFU /
    (8 x params) (32B on H20: ~200 tokens/s)."""
    train_attention: bool = True
    """Training time grows with sequence length: each sequence also costs its causal attention FLOPs,
    8 x layers x q_dim x L^2 (sim/hardware.train_attention_tokens2); False: linear in tokens."""
    train_overhead_s: float = 5.0
    """Fixed seconds per training step (optimizer, data loading, reward stragglers)."""
    push_s: float | None = None
    """Trainer -> Parameter Server push of one version. None: weights at 16 GB/s (32B: 4.1 s; PSRL commit
    log: 32B push 7 s -> 4 s with NIXL)."""
    pull_s: float | None = None
    """Instance pull of one version from the PS. None: weights at 32 GB/s (32B: 2.0 s; PSRL: 25 s -> 2 s)."""
    ps_egress_gb_s: float | None = None
    """Parameter Server egress shared by pulls in flight at once (GB/s): k pulls each run at
    min(pull bandwidth, egress / k). None: 25 GB/s (one 200 Gb/s NIC) per trainer GPU, whose ranks hold the
    PS's shards (an assumption); 0: pulls never contend."""
    broadcast_s: float | None = None
    """Peers' weight update: NCCL broadcast from the trainer to every instance (no PS). None: weights at
    --broadcast-gb-s. AReaL, verl fully-async and PipelineRL pause every instance and the trainer for it; verl
    one-step-off pays it at the batch boundary."""
    broadcast_gb_s: float = 32.0
    """Bandwidth of the peers' broadcast and of verl-sync's in-place switch (GB/s). Default: StaleFlow's pull
    bandwidth, so every system moves weights into an instance at the same rate (issue 49's fairness; the
    PS push, trainer -> PS at 16 GB/s, stays StaleFlow's own). 8.25: verl's checkpoint engine as measured (the
    default before 2026-12-07: 32B in 8.2 s)."""
    push_blocks_trainer: bool = False
    """staleflow: the trainer waits for its push to the PS before its next step (the grid's equal-transfer
    column; PSRL's exclusive push lock suggests it). False: the push overlaps the next step."""
    colocated_switch_s: float | None = None
    """verl-sync only: in-place weight update + rollout/train memory switch per step. None: weights at
    --broadcast-gb-s + 2 s (32B: 4.0 s)."""
    kv_move_gb_s: float = 16.0
    """A migrated trajectory's KV moves with it at this bandwidth (GB/s; the source offloads it, the
    destination loads it, each stalling its decoding for bytes / bandwidth) instead of being recomputed by
    a prefill. 0: recomputed (the peers never migrate; their loop-backs follow a weight update and must
    re-prefill). Default 16 GB/s: the PS push rate (PSRL's NIXL numbers), below the 32 GB/s pull. Needs the
    model's KV bytes per token (sim/hardware.MODEL_SPECS): off for a cost model without a known architecture."""
    spec_accept: float = 2.0
    """Speculative decoding, every mode (each peer's engine, vLLM, has suffix/n-gram drafting): tokens per
    verify forward (accepted drafts + the bonus token; 1: off). Default 2.0, an assumption below Seer's grouped
    drafting (mean accepted length 2.85, arXiv 2511.14617 as summarised) and in line with the <= 2x rollout
    speed-ups of SpecRL (verl recipe specRL: up to 2.1x) and DAS (arXiv 2511.13841: up to 50 % less rollout
    time). Our own engine measured 1.04-1.16 with SmolLM2-135M at T=1 on CPU (docs/perf.md, 2026-12-07,
    scripts/bench_speculative.py): a small model at full temperature, not this regime; the grid's sweep
    covers both. An engine speculates only where a verify forward is cheaper per token (sim/speculative.py)."""
    spec_draft_tokens: int = 4
    """Draft tokens verified per sequence and forward (a verify costs the decode latency of n x (draft + 1)
    token rows; sim/speculative.py)."""
    # ---- noise and what the router knows -------------------------------------------------------
    step_noise: float = 0.05
    """Sigma of the log-normal factor on each stretch of decode steps (jitter, interference)."""
    instance_spread: float = 0.03
    """Sigma of each instance's fixed log speed factor (hardware and placement differ)."""
    train_noise: float = 0.03
    """Sigma of the log-normal factor on each training step."""
    router_fit_samples: int = 200
    """The router's cost model is FITTED (coordinator.fit_cost_model) to this many noisy step times of
    the simulated instances, as on a real cluster; 0 = it sees the true model (tests only)."""
    router_fit_noise: float = 0.1
    """Sigma of the log-normal noise on those profiling samples."""
    shared_cores: int = 0
    """CPU runtime model (scripts/bench_modes.py): the ranks share this many cores, so an instance with work
    decodes and prefills max(1, busy / shared_cores) times slower, busy counting the instances with work and
    the trainer while it trains (time slicing). The trainer's own step time is an input (train_tokens_per_gpu_s,
    train_overhead_s): give it as measured under the same sharing. 0: dedicated devices (GPUs)."""
    colocated_sync: bool = True
    """verl-sync colocates rollout and training on all GPUs (the peer's hybrid engine); False runs it on the
    same separate ranks as every other mode (what the CPU runtime does)."""
    # ---- workload ----------------------------------------------------------------------------
    staleness: StalenessConfig = field(default_factory=lambda: StalenessConfig(batch_size=32, group_size=8))
    """The protocol's settings, as in a training run (--staleness.batch-size B = 32 groups per step: the
    authors' all-strategies script; --staleness.group-size N = 8 responses per prompt; redundancy B' - B
    and N' - N, the straggler rule and --staleness.train-order: staleflow only). Its eta is replaced by each
    bound of --eta."""
    prompt_len: int = 512
    """Prompt tokens (DAPO-Math prompts are a few hundred tokens; max prompt 2k in the scripts)."""
    length_dist: Literal["lognormal", "long-cot"] = "lognormal"
    """Response lengths: lognormal (median, sigma below) or long-cot (a mixture parametrised from published
    long-CoT RL statistics: sim/lengths.py)."""
    response_median: float = 4000.0
    """Median response length (lognormal). Assumption: long-CoT math reasoning at 20k max."""
    response_sigma: float = 0.8
    """Lognormal sigma of response lengths (long tail). Assumption."""
    max_response: int = 20000
    """Cap on response tokens (paper-32b: 20k)."""
    lengths_file: str = ""
    """Optional empirical response lengths (one int per line), sampled with replacement instead of the lognormal."""
    tool_calls_min: int = 0
    """Multi-turn, tool-using trajectories (sim/turns.py): tool calls per trajectory, uniform in
    [tool_calls_min, tool_calls_max]; the drawn response length (model tokens) is split into calls + 1
    turns with a tool wait and an observation between turns. 0 and 0: single-turn (no tools)."""
    tool_calls_max: int = 0
    """Upper end of the tool calls per trajectory (see tool_calls_min)."""
    tool_latency_median_s: float = 2.0
    """Median seconds of one tool call (lognormal; docs/simulator.md "Tool latency": an assumption with its
    sources)."""
    tool_latency_p99_s: float = 30.0
    """99th percentile seconds of one tool call (the lognormal's tail: a cold sandbox, a slow test run)."""
    tool_obs_tokens: int = 300
    """Observation tokens appended after each tool call (prefilled, not decoded; in the trained sequence,
    loss-masked; not counted against max_response, which caps the model's tokens)."""
    # ---- staleness, modes, strategies ---------------------------------------------------------
    eta: tuple[int, ...] = (1, 2, 3)
    """Staleness bounds simulated for the asynchronous modes (verl-sync always 0, verl-one-step-off always 1)."""
    modes: tuple[str, ...] = DEFAULT_MODES
    """Modes to simulate side by side (staleflow, the baselines, the ablations: docs/baselines.md; a fork's
    'package.module:Class'); --grid searches the peers among them."""
    coordinator: CoordinatorConfig = field(
        default_factory=lambda: CoordinatorConfig(cost_model="qwen2.5-32b-tp2", keep_kv_on_pull=True, pull="greedy")
    )
    """Strategy settings of the staleflow mode (the baselines override theirs, see staleflow.modes).
    Its cost_model field is not used here: --cost-model sets the instances and the router alike. The
    simulated StaleFlow keeps KV across an in-flight weight update (keep_kv_on_pull; the runtime's rollout
    ranks do so with --coordinator.keep-kv-on-pull, off by default there: docs/simulator.md) and then pulls greedily: with nothing interrupted by a pull, waiting for an idle instance (status
    pull, the runtime's default) read 1.027 at the paper-like centre (docs/perf.md, issue 49). Tail lanes
    (--coordinator.tail-lanes, coordinator/lanes.py) are off: with speculative decoding they read 1.023 there."""
    peer: PeerSettings = field(default_factory=PeerSettings)
    """The peers' own knobs (--peer.<mode>.<knob>), each applied to its own mode's runs (--grid searches them)."""
    ablation: bool = True
    """Also run staleflow with each part removed in turn (at the largest eta)."""
    jobs: int = 0
    """--grid: settings simulated in parallel processes (0: one per CPU core)."""
    grid: Literal["", "paper"] = ""
    """'paper': run the evaluation grid (2 models x eta 1-3 x 2 length distributions x 2 splits, the authors'
    two shapes, the load axis and one 1024-GPU setting; every mode, ablations at the paper-like centre)
    instead of this one setting."""
    grid_settings: str = ""
    """--grid paper: run only the settings whose name contains one of these comma-separated strings (e.g.
    'authors' or 'x1024,x2048'; a trailing '$' matches the name's end: '64:64$'); ablations run at the paper-like centre if it is among them, else at the
    first setting's largest eta. '' = every setting."""
    smoke: bool = False
    """--grid paper --smoke: the authors' two shapes only, 12 steps per run, one ablation seed (a quick check)."""
    # ---- simulation control ------------------------------------------------------------------
    steps: int = 48
    """Training steps simulated per run."""
    warmup_steps: int = 8
    """Steps excluded from the throughput measurement (pipeline fill); 40 are measured (the grid's peer
    search reads each peer's worst-case staleness over at least 40 measured steps per seed)."""
    tick_s: float = 1.0
    """Simulated seconds between coordinator ticks (the real loop ticks every 10 ms; events inside a
    tick are applied at its end, so this is the timing resolution)."""
    max_sim_s: float = 200000.0
    """Stop a run that has not finished `steps` by this simulated time (reported as incomplete)."""
    seed: int = 0
    """Seed of the simulated lengths and arrival order."""
    out_dir: str = "runs/sim"
    """Where the PNG plot and results.json go ('' = do not write files)."""

    def __post_init__(self):
        _check(self.total_gpus >= 2, "total-gpus", self.total_gpus, "need >= 2 GPUs")
        _check(self.gpus_per_instance >= 1, "gpus-per-instance", self.gpus_per_instance, "must be >= 1")
        _check(
            self.gpus_per_instance <= self.rollout_gpus < self.total_gpus,
            "rollout-gpus",
            self.rollout_gpus,
            f"must be in [gpus-per-instance, total-gpus) = [{self.gpus_per_instance}, {self.total_gpus})",
        )
        for name in (
            "prefill_tokens_per_s",
            "train_tokens_per_gpu_s",
            "response_median",
            "gpu_memory_gb",
            "gpu_tflops",
            "kv_capacity",
        ):
            v = getattr(self, name)
            _check(v is None or v > 0, name.replace("_", "-"), v, "must be > 0 (or unset: derived)")
        for name in (
            "train_overhead_s",
            "push_s",
            "pull_s",
            "broadcast_s",
            "ps_egress_gb_s",
            "colocated_switch_s",
            "response_sigma",
            "kv_move_gb_s",
            "step_noise",
            "instance_spread",
            "train_noise",
            "router_fit_noise",
            "router_fit_samples",
        ):
            v = getattr(self, name)
            _check(v is None or v >= 0, name.replace("_", "-"), v, "must be >= 0")
        _check(self.length_dist in LENGTH_DISTS, "length-dist", self.length_dist, f"choose {', '.join(LENGTH_DISTS)}")
        _check(self.max_running >= 1, "max-running", self.max_running, "must be >= 1")
        _check(self.broadcast_gb_s > 0, "broadcast-gb-s", self.broadcast_gb_s, "must be > 0")
        _check(self.spec_draft_tokens >= 1, "spec-draft-tokens", self.spec_draft_tokens, "must be >= 1")
        _check(
            1.0 <= self.spec_accept <= self.spec_draft_tokens + 1,
            "spec-accept",
            self.spec_accept,
            f"must be in [1, spec-draft-tokens + 1 = {self.spec_draft_tokens + 1}] (1: off)",
        )
        _check(self.prefill_chunk_tokens >= 0, "prefill-chunk-tokens", self.prefill_chunk_tokens, "must be >= 0")
        _check(self.jobs >= 0, "jobs", self.jobs, "must be >= 0 (0: one per CPU core)")
        _check(self.shared_cores >= 0, "shared-cores", self.shared_cores, "must be >= 0 (0: dedicated devices)")
        _check(self.prompt_len >= 1, "prompt-len", self.prompt_len, "must be >= 1")
        _check(self.max_response >= 1, "max-response", self.max_response, "must be >= 1")
        _check(
            0 <= self.tool_calls_min <= self.tool_calls_max,
            "tool-calls-max",
            self.tool_calls_max,
            f"must be >= tool-calls-min ({self.tool_calls_min}) >= 0",
        )
        _check(self.tool_latency_median_s > 0, "tool-latency-median-s", self.tool_latency_median_s, "must be > 0")
        _check(
            self.tool_latency_p99_s >= self.tool_latency_median_s,
            "tool-latency-p99-s",
            self.tool_latency_p99_s,
            f"must be >= tool-latency-median-s ({self.tool_latency_median_s})",
        )
        _check(self.tool_obs_tokens >= 0, "tool-obs-tokens", self.tool_obs_tokens, "must be >= 0")
        _check(bool(self.eta) and all(e >= 0 for e in self.eta), "eta", self.eta, "give one or more bounds >= 0")
        _check(bool(self.modes), "modes", self.modes, f"give one or more of {', '.join(MODES)}")
        for m in self.modes:
            if ":" in m:  # a fork's mode: imported and checked now (the error names the import)
                check_mode(m)
                continue
            known = m in MODES or any(m in c.aliases for c in MODES.values())
            _check(
                known, "modes", m, f"unknown mode; choose from {', '.join(MODES)} or a fork's 'package.module:Class'"
            )
        _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        _check(
            0 <= self.warmup_steps < self.steps,
            "warmup-steps",
            self.warmup_steps,
            f"must be in [0, steps) = [0, {self.steps})",
        )
        _check(self.tick_s > 0, "tick-s", self.tick_s, "must be > 0")
        _check(self.max_sim_s > 0, "max-sim-s", self.max_sim_s, "must be > 0")


def preset_paper_32b() -> SimConfig:
    """128 GPUs, Qwen2.5-32B TP2 cost model (PSRL coefficients), GRPO group 8, 20k max response."""
    return SimConfig()


def preset_cpu_small() -> SimConfig:
    """The default CPU job's shape: 3 processes (1 trainer + 2 rollout instances), SmolLM2-135M CPU cost model."""
    return SimConfig(
        total_gpus=3,
        rollout_gpus=2,
        gpus_per_instance=1,
        cost_model="cpu-smollm2",
        prefill_tokens_per_s=400.0,
        max_running=64,
        train_tokens_per_gpu_s=300.0,
        train_overhead_s=0.5,
        push_s=0.3,
        pull_s=0.3,
        broadcast_s=0.4,
        colocated_switch_s=0.3,
        spec_accept=1.0,  # the CPU runtime decodes one token per step (its twin in scripts/bench_modes.py too)
        staleness=StalenessConfig(batch_size=8, group_size=4),
        prompt_len=64,
        response_median=96.0,
        response_sigma=0.6,
        max_response=256,
        eta=(1, 2),
        coordinator=CoordinatorConfig(cost_model="cpu-smollm2"),
        steps=12,
        warmup_steps=2,
        tick_s=0.05,
        out_dir="runs/sim-cpu",
    )


PRESETS: dict[str, Callable[[], SimConfig]] = {"paper-32b": preset_paper_32b, "cpu-small": preset_cpu_small}


def replace(cfg: SimConfig, **changes) -> SimConfig:
    try:
        return dataclasses.replace(cfg, **changes)
    except TypeError as e:
        raise ConfigError(f"bad SimConfig field: {e}") from None
