"""What the simulator derives from a model's size and the GPU instead of assuming it.

A cost-model preset (coordinator/presets) is a fitted decode-step latency of one instance; its
``kv_capacity`` there is a hand estimate. Here the model's architecture (``MODEL_SPECS``: public
config.json values of the Qwen2.5 / Qwen3 models the PSRL coefficients were fitted on) and the GPU
(memory, bf16 FLOP/s) give, per instance:
  KV capacity     (GPU memory x utilisation - weights - activation reserve) / KV bytes per token,
                  per GPU of the tensor-parallel group (KV heads split across TP, replicated when
                  fewer than TP);
  prefill rate    TP x peak FLOP/s x prefill MFU / (2 x params) tokens/s (KV recompute after an
                  interrupt costs the same), or the rate a refit measured on that GPU (fitted_prefill);
and per trainer GPU the training rate peak x train MFU / (8 x params) tokens/s (forward, backward
and the log-prob recompute), the weight-transfer times from the bf16 weight bytes, and the rate at
which a migrated trajectory's KV moves (its KV bytes per token at the KV-transfer bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.cluster.placement import ps_egress_gb_s


@dataclass(frozen=True)
class ModelSpec:
    params_b: float
    """Parameters, billions (bf16 weights: 2 bytes each)."""
    layers: int
    kv_heads: int
    head_dim: int
    tp: int
    """Tensor-parallel size of one rollout instance (GPUs per instance)."""
    active_b: float = 0.0
    """Parameters active per token, billions (MoE); 0 = all (dense). FLOPs scale with these."""
    q_dim: int = 0
    """Query heads x head_dim: the attention FLOPs of training grow with it and with sequence length."""

    @property
    def flop_params(self) -> float:
        return (self.active_b or self.params_b) * 1e9

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params_b * 1e9


MODEL_SPECS: dict[str, ModelSpec] = {
    # Qwen2.5-7B: 28 layers, 4 KV heads x 128; Qwen2.5-14B: 48 x 8 x 128; Qwen2.5-32B: 64 x 8 x 128;
    # Qwen3-30B-A3B: 48 layers, 4 KV heads x 128 (config.json of each model on the Hugging Face hub)
    # Query heads x 128: 7B 28, 14B 40, 32B 40, 30B-A3B 32 (same config.json files).
    "qwen2.5-7b-tp1": ModelSpec(7.62, 28, 4, 128, 1, q_dim=3584),
    "qwen2.5-7b-tp2": ModelSpec(7.62, 28, 4, 128, 2, q_dim=3584),
    "qwen2.5-14b": ModelSpec(14.8, 48, 8, 128, 1, q_dim=5120),
    "qwen2.5-32b-tp2": ModelSpec(32.8, 64, 8, 128, 2, q_dim=5120),
    "qwen2.5-32b-tp4": ModelSpec(32.8, 64, 8, 128, 4, q_dim=5120),
    "qwen3-30b-a3b": ModelSpec(30.5, 48, 4, 128, 1, active_b=3.3, q_dim=4096),
}


@dataclass(frozen=True)
class Profile:
    """A GPU's published numbers (docs/simulator.md has each source and the arithmetic)."""

    memory_gb: float
    bf16_tflops: float
    """Dense bf16 peak (no sparsity)."""
    hbm_tb_s: float
    source: str


PROFILES: dict[str, Profile] = {
    "h20": Profile(96.0, 148.0, 4.0, "NVIDIA H20 (HGX): 96 GB HBM3, 4.0 TB/s, 148 TFLOP/s dense bf16"),
    "h100": Profile(80.0, 989.0, 3.35, "NVIDIA H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16"),
    "h200": Profile(141.0, 989.0, 4.8, "NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16"),
}
FIT_PROFILE = "h20"
"""Where the shipped decode coefficients were fitted (PSRL's cost_model files: presumably its 128-H20 cluster)."""


CPU_PROFILE = "cpu"
"""The CPU presets (``cpu-*``): fitted on the machine that runs the CPU jobs; a refit overwrites the preset."""
REFIT_PROFILES = (*PROFILES, CPU_PROFILE)
"""Every profile scripts/fit_cost_model.py --profile refits from a device run's cost samples (sim/cost_samples.py)."""

# the coordinator preset of a profiled model: (model family as in MODEL_SPECS / the cpu presets, TP) -> preset
_GPU_PRESETS = {("qwen2.5-7b", 1): "qwen2.5-7b-tp1", ("qwen2.5-7b", 2): "qwen2.5-7b-tp2", ("qwen2.5-14b", 1):
                "qwen2.5-14b", ("qwen2.5-32b", 2): "qwen2.5-32b-tp2", ("qwen2.5-32b", 4): "qwen2.5-32b-tp4",
                ("qwen3-30b-a3b", 1): "qwen3-30b-a3b"}  # fmt: skip
_CPU_PRESETS = {"smollm2-135m": "cpu-smollm2", "tiny-llama": "cpu-tiny-llama"}


def profile_of_device(device: str, gpu: str | None) -> str | None:
    """The profile a device run measured: 'cpu', or the GPU's name matched to h20 / h100 / h200 (None: unknown)."""
    import re

    if device == "cpu":
        return CPU_PROFILE
    for name in sorted(PROFILES, key=len, reverse=True):  # h200 before h20
        if re.search(rf"\b{name}\b", gpu or "", re.IGNORECASE):
            return name
    return None


def preset_of_model(model: str, tp: int, profile: str) -> str | None:
    """The coordinator preset a run of ``model`` (a bundled name, hub id or folder) at ``tp`` refits, or None."""
    base = model.rstrip("/").rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    if profile == CPU_PROFILE:
        return _CPU_PRESETS.get(base) if tp == 1 else None
    return _GPU_PRESETS.get((base, tp))


def refit_name(preset: str, profile: str) -> str:
    """The preset file (presets/<name>.json) a refit of ``preset`` on ``profile`` writes: the preset itself where
    it is that profile's own fit (PSRL's presets are h20's; cpu-* are the CPU's; a name ending in -<profile>, e.g.
    gpu-7b-h100), else <preset>-<profile>, which profile_cost then prefers to rescaling the h20 fit. ValueError
    for a CPU preset on a GPU profile or the reverse (a one-line reason)."""
    if profile not in REFIT_PROFILES:
        raise ValueError(f"profile {profile!r} is unknown: use one of {', '.join(REFIT_PROFILES)}")
    cpu_preset = preset.startswith("cpu-")
    if cpu_preset != (profile == CPU_PROFILE):
        raise ValueError(
            f"preset {preset!r} is a {'CPU' if cpu_preset else 'GPU'} preset and profile {profile!r} is not: refit "
            f"cpu-* presets with --profile cpu and the GPU presets with --profile {', '.join(PROFILES)}"
        )
    other = [p for p in PROFILES if p != profile and preset.endswith(f"-{p}")]
    if other:
        raise ValueError(f"preset {preset!r} is fitted on {other[0]}: refit it with --profile {other[0]}")
    own = cpu_preset or preset.endswith(f"-{profile}") or (profile == FIT_PROFILE and not preset.startswith("gpu-"))
    return preset if own else f"{preset}-{profile}"


def profile_cost(cost, hardware: str):
    """The decode cost model of `cost` on `hardware`: a preset fitted there ('<name>-<hardware>.json', written by
    scripts/fit_cost_model.py --profile) if one exists, else the H20 fit rescaled from the spec sheets: the
    memory-bound terms (k1 reads KV, k2 reads the weights) by the HBM bandwidth ratio, the compute-bound slope
    k3 and its intercept b3 by the bf16 FLOP/s ratio, the per-step host overhead k4 kept. Same name (the
    architecture lookup keys on it); the source says which it is."""
    import dataclasses

    from staleflow.coordinator.cost_model import CostModelError, load_cost_model

    if hardware == FIT_PROFILE:
        return cost
    try:
        fitted = load_cost_model(f"{cost.name}-{hardware}")
        return dataclasses.replace(fitted, name=cost.name, source=f"fitted on {hardware}: {fitted.source}")
    except CostModelError:
        pass
    fit, hw = PROFILES[FIT_PROFILE], PROFILES[hardware]
    mem, flop = fit.hbm_tb_s / hw.hbm_tb_s, fit.bf16_tflops / hw.bf16_tflops
    return dataclasses.replace(
        cost,
        k1=cost.k1 * mem,
        k2=cost.k2 * mem,
        k3=cost.k3 * flop,
        b3=cost.b3 * flop,
        source=f"{cost.name} ({FIT_PROFILE} fit) rescaled to {hardware}: k1, k2 x {mem:.3f}, k3, b3 x {flop:.3f}",
    )


def fitted_prefill(cost_name: str, hardware: str) -> float | None:
    """Prefill tokens/s measured on ``hardware`` by the run a refitted preset came from (its fit's
    prefill_tokens_per_s, written by scripts/fit_cost_model.py --profile), or None: no refit, or one without
    prefill steps. The simulator uses it instead of the spec-sheet FLOP/s x prefill MFU."""
    import json

    from staleflow.coordinator.cost_model import PRESET_DIR

    try:
        raw = json.loads((PRESET_DIR / f"{refit_name(cost_name, hardware)}.json").read_text())
    except (ValueError, OSError):  # no such refit (or a CPU preset on a GPU profile)
        return None
    fit = raw.get("fit") if isinstance(raw, dict) else None
    if not isinstance(fit, dict) or fit.get("profile") != hardware:
        return None
    rate = fit.get("prefill_tokens_per_s")
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0 else None


@dataclass(frozen=True)
class GPU:
    memory_gb: float = 96.0
    """H20: 96 GB HBM3 (the paper's cluster: 128 H20)."""
    bf16_tflops: float = 148.0
    """H20 dense bf16 peak."""
    mem_util: float = 0.9
    """vLLM gpu_memory_utilization."""
    reserve_gb: float = 4.0
    """Activations, CUDA graphs and the allocator's slack per GPU."""
    prefill_mfu: float = 0.4
    train_mfu: float = 0.35


def kv_capacity(spec: ModelSpec, gpu: GPU) -> int:
    """KV-cache tokens one instance (spec.tp GPUs) can hold."""
    free = gpu.memory_gb * 1e9 * gpu.mem_util - spec.weight_bytes / spec.tp - gpu.reserve_gb * 1e9
    heads = max(1.0, spec.kv_heads / spec.tp)
    per_token = spec.layers * 2 * heads * spec.head_dim * 2  # K and V, bf16, per GPU
    if free <= per_token:
        raise ValueError(
            f"a {spec.params_b}B model at TP{spec.tp} does not fit in {gpu.memory_gb} GB x "
            f"{gpu.mem_util}; raise --gpus-per-instance or use a larger GPU"
        )
    return int(free / per_token)


def kv_bytes_per_token(spec: ModelSpec) -> float:
    """KV-cache bytes of one token on a whole instance (K and V, every layer and KV head, bf16)."""
    return spec.layers * 2 * spec.kv_heads * spec.head_dim * 2.0


def prefill_tokens_per_s(spec: ModelSpec, gpu: GPU) -> float:
    return spec.tp * gpu.bf16_tflops * 1e12 * gpu.prefill_mfu / (2.0 * spec.flop_params)


def train_tokens_per_gpu_s(spec: ModelSpec, gpu: GPU) -> float:
    return gpu.bf16_tflops * 1e12 * gpu.train_mfu / (8.0 * spec.flop_params)


def train_attention_tokens2(spec: ModelSpec) -> float:
    """Training FLOPs per squared token of a sequence, over the linear 8 x params per token: causal attention
    is 2 x layers x q_dim x L^2 FLOPs forward (QK^T and AV, half the matrix), x 4 for forward, backward (2x)
    and the log-prob recompute. Divided by 8 x params it is the extra "tokens" an L-token sequence costs:
    L^2 x this factor (7B at L = 20k: +26 % over the linear term)."""
    return 8.0 * spec.layers * spec.q_dim / (8.0 * spec.flop_params) if spec.q_dim else 0.0


def transfer_s(spec: ModelSpec, gb_per_s: float) -> float:
    """Seconds to move the bf16 weights at this bandwidth."""
    return spec.weight_bytes / (gb_per_s * 1e9)


@dataclass(frozen=True)
class Derived:
    """The numbers one simulated run uses: explicit SimConfig values, else derived from model and GPU."""

    kv_capacity: int
    prefill_tokens_per_s: float
    train_tokens_per_gpu_s: float
    push_s: float
    pull_s: float
    broadcast_s: float
    colocated_switch_s: float
    kv_move_tokens_per_s: float = 0.0
    """KV tokens per second a migrated trajectory's KV moves at (0: no KV move, it is recomputed)."""
    train_attention: float = 0.0
    """Extra training "tokens" per squared sequence length (train_attention_tokens2; 0: linear in tokens)."""
    pull_share: float = 0.0
    """Fraction of the Parameter Server's egress one full-speed pull takes (pull bandwidth / egress): k pulls
    at once each take max(1, k x pull_share) x pull_s. 0: pulls never contend."""


def derive(cfg, cost) -> Derived:
    """Fill the None fields of a SimConfig from the cost model's architecture (MODEL_SPECS) and the GPU."""
    spec = MODEL_SPECS.get(cost.name)
    prof = PROFILES[cfg.hardware]
    gpu = GPU(memory_gb=cfg.gpu_memory_gb or prof.memory_gb, bf16_tflops=cfg.gpu_tflops or prof.bf16_tflops)

    def pick(value, derived, what):
        if value is not None:
            return value
        if spec is None:
            raise ValueError(
                f"--{what} is unset and cost model {cost.name!r} has no known architecture to derive "
                f"it from (known: {', '.join(MODEL_SPECS)}); give --{what}"
            )
        return derived()

    return Derived(
        kv_capacity=cfg.kv_capacity or (kv_capacity(spec, gpu) if spec else cost.kv_capacity),
        prefill_tokens_per_s=pick(
            cfg.prefill_tokens_per_s,
            lambda: fitted_prefill(cost.name, cfg.hardware) or prefill_tokens_per_s(spec, gpu),
            "prefill-tokens-per-s",
        ),
        train_tokens_per_gpu_s=pick(
            cfg.train_tokens_per_gpu_s, lambda: train_tokens_per_gpu_s(spec, gpu), "train-tokens-per-gpu-s"
        ),
        push_s=pick(cfg.push_s, lambda: transfer_s(spec, 16.0), "push-s"),
        pull_s=pick(cfg.pull_s, lambda: transfer_s(spec, 32.0), "pull-s"),
        broadcast_s=pick(cfg.broadcast_s, lambda: transfer_s(spec, cfg.broadcast_gb_s), "broadcast-s"),
        colocated_switch_s=pick(
            cfg.colocated_switch_s, lambda: transfer_s(spec, cfg.broadcast_gb_s) + 2.0, "colocated-switch-s"
        ),
        kv_move_tokens_per_s=cfg.kv_move_gb_s * 1e9 / kv_bytes_per_token(spec) if spec else 0.0,
        train_attention=train_attention_tokens2(spec) if spec and cfg.train_attention else 0.0,
        pull_share=pull_share(cfg, spec, cfg.pull_s) if spec else 0.0,
    )


def pull_share(cfg, spec: ModelSpec, pull_s: float | None) -> float:
    """Pull bandwidth (weights / pull_s) over the PS egress (--ps-egress-gb-s; None: 25 GB/s, one 200 Gb/s
    NIC, per trainer GPU: the PS's shards live on the trainer ranks)."""
    if cfg.ps_egress_gb_s == 0:
        return 0.0
    egress = cfg.ps_egress_gb_s or ps_egress_gb_s(cfg.total_gpus - cfg.rollout_gpus)  # the runtime's placement
    per_pull = spec.weight_bytes / (pull_s or transfer_s(spec, 32.0)) / 1e9
    return per_pull / max(egress, per_pull)  # one pull alone always runs at its own bandwidth
