"""Bytes per rank, counted from the runtime's own objects built on the meta device.

Exact counts (the same objects the runtime allocates, or the rule FSDP2 applies):
- trainer weights: our CausalLM in MASTER_DTYPE, FSDP2's padded dim-0 shard (ceil(n / W) rows
  per rank); gradients the same; AdamW's exp_avg / exp_avg_sq (unpadded local shard) + step;
  the KL reference in the compute dtype, sharded like the policy;
- Parameter Server: ``ParamLayout`` of the policy in ``slot_dtype`` split into the slot pieces
  (placement.py), two slots;
- rollout ranks: what their engine backend counts (staleflow.engines, ``plan_rank``) with the
  estimates ``RolloutSite`` shares: e.g. the built-in engine's CausalLM in the rollout dtype after
  ``fuse_projections`` and its PagedAttention tensors from --rollout.max-kv-tokens / block size.
Estimates (stated as such in docs/memory-plan.md):
- activations: the bytes autograd saves for one of our decoder layers (counted with
  saved-tensor hooks on meta tensors; attention keeps q, k, v, output and an fp32 log-sum-exp, as
  flash kernels do), x layers, or with activation checkpointing the layer inputs plus one
  layer's set twice (its recompute and its backward);
- FSDP2 buffers in flight, the log-prob op, the engine's step workspace and sampler;
- CUDA contexts, NCCL and the caching allocator's slack: constants below (an engine's own, in its backend).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from staleflow.plan.architecture import meta_model, unique_bytes
from staleflow.plan.transients import (
    adamw_step_bytes,
    addmm_out_dtype_inplace,
    cuda_graph_pool_bytes,
    logprob_backward_bytes,
    mlp_per_token,
    prefill_mask_bytes,
)

MiB, GiB = 2**20, 2**30
PRIMARY_CONTEXT_BYTES = 600 * MiB
"""A torch process's own CUDA context with lazy module loading, cuBLAS workspace and the kernels
it loads (H100, CUDA 12/13; 0.4-0.7 GiB is typical). The device check measures it."""
PEER_CONTEXT_BYTES = 300 * MiB
"""A context a process creates on another GPU only to map IPC memory and copy from it."""
NCCL_BYTES = 512 * MiB
"""NCCL communicator buffers of a trainer rank (one group, NVLink)."""
NCCL_PULL_BYTES = 128 * MiB
"""One remote puller's NCCL group (launch/dist.make_groups: the slot piece owners + that rollout rank),
on each member: the communicator's device state and the point-to-point buffers of its one peer
connection (NCCL_BUFFSIZE 4 MiB x channels, both directions). An estimate: one GPU cannot measure it."""
ALLOCATOR_SLACK = 0.05
"""The caching allocator's rounding and fragmentation on top of live tensors."""
CATEGORIES = (
    "weights",
    "grads",
    "optimizer",
    "reference",
    "slots",
    "kv_cache",
    "activations",
    "buffers",
    "workspace",
    "prefill_mask",
    "graphs",
    "logprob_bwd",
    "optim_step",
    "contexts",
    "slack",
)
PHASES = {"activations": "backward", "logprob_bwd": "backward", "optim_step": "optimizer step"}
"""Categories that are never live together: the activations and the log-prob backward's workspace
exist until backward ends, AdamW's temporaries only in the optimizer step after it. A rank's peak
takes the larger phase, not their sum."""


@dataclass
class RankPlan:
    rank: int
    role: str
    gpu: int | None
    items: dict[str, int] = field(default_factory=dict)
    """Category (CATEGORIES) -> bytes at the steady-state peak."""
    load_peak: int = 0
    """Bytes while the rank loads its model (before sharding / casting)."""
    notes: list[str] = field(default_factory=list)

    def add(self, category: str, nbytes: float, note: str = "") -> None:
        self.items[category] = self.items.get(category, 0) + int(nbytes)
        if note:
            self.notes.append(f"{category}: {note}")

    def finish(self) -> RankPlan:
        self.items["slack"] = int(self._live(exclude=("contexts", "slack")) * ALLOCATOR_SLACK)
        return self

    def _live(self, exclude: tuple[str, ...] = ()) -> int:
        """Bytes at the rank's peak: every category, but only the larger of the PHASES that never overlap."""
        always = sum(v for k, v in self.items.items() if k not in PHASES and k not in exclude)
        phases: dict[str, int] = {}
        for k, phase in PHASES.items():
            phases[phase] = phases.get(phase, 0) + self.items.get(k, 0)
        return always + max(phases.values(), default=0)

    @property
    def steady(self) -> int:
        return self._live()

    @property
    def peak(self) -> int:
        return max(self.steady, self.load_peak)


class _AttentionSaves(torch.autograd.Function):
    """Stand-in for a fused attention kernel on meta tensors: keeps what flash-attn's varlen kernel
    and torch's flash SDPA keep for backward (q, k, v, output, fp32 log-sum-exp [H, T]). On the
    meta device SDPA would take its math path, which keeps [H, T, T] probabilities no GPU kernel keeps."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: only the saved tensors are counted
        raise RuntimeError("_AttentionSaves is a meta-device stand-in for counting saved tensors; it has no backward")


def layer_saved_bytes(args, tokens: int, dtype: torch.dtype, expand_kv: bool, layer_idx: int = 0) -> int:
    """Bytes autograd keeps for our decoder layer ``layer_idx`` over ``tokens`` packed tokens in
    ``dtype`` (parameters excluded). ``expand_kv``: K/V repeated to every query head first, as
    PackedAttention's SDPA path does (without flash-attn). A mixture-of-experts layer is counted with
    its tokens spread evenly over the experts (on the meta device routing is unknown; the gathered
    [T k, H] rows and each expert's SwiGLU inputs do not depend on the spread)."""
    from staleflow.model.transformer import DecoderLayer

    with torch.device("meta"):
        layer = DecoderLayer(args, layer_idx).to(dtype)
        x = torch.empty(tokens, args.hidden_size, dtype=dtype, requires_grad=True)
        cos = torch.empty(tokens, 1, args.head_dim, dtype=dtype)
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    group = args.num_heads // args.num_kv_heads

    def attn(layer_idx, q, k, v):
        if expand_kv and group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return _AttentionSaves.apply(q, k, v)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, cos, attn)
    return sum(saved.values())


_SAVED: dict[tuple, int] = {}


def _saved_once(args, tokens: int, dtype: torch.dtype, expand_kv: bool, layer_idx: int) -> int:
    """layer_saved_bytes, computed once per distinct question (every trainer rank asks the same)."""
    key = (repr(args), tokens, dtype, expand_kv, layer_idx)
    if key not in _SAVED:
        _SAVED[key] = layer_saved_bytes(args, tokens, dtype, expand_kv, layer_idx)
    return _SAVED[key]


def _fsdp_padded(shape, world: int) -> int:
    """Elements FSDP2 allocates per rank for a parameter: ceil(rows / world) rows (padded)."""
    rows = shape[0] if len(shape) else 1
    return -(-rows // world) * math.prod(shape[1:])


def trainer_rank(
    cfg, args, rank: int, world: int, device_type: str, slot_piece_bytes: int, flash: bool, lm=None
) -> RankPlan:
    """A trainer rank of ``world`` (FSDP2 when world > 1; one unsharded rank with autocast else).
    ``lm``: the policy on the meta device in MASTER_DTYPE, when the caller has built it already (a
    Qwen3-30B-A3B takes seconds to build, even on the meta device)."""
    from staleflow.servers.layout import piece_rows
    from staleflow.train.logprobs import DEFAULT_CHUNK_ELEMENTS
    from staleflow.train.parallelize import MASTER_DTYPE, activation_checkpointing_on, compute_dtype, mixed_precision

    plan = RankPlan(rank, "trainer", None)
    lm = lm if lm is not None else meta_model(args, MASTER_DTYPE)
    named = list(lm.named_parameters())
    shapes = [tuple(p.shape) for _, p in named]
    total = sum(math.prod(s) for s in shapes)
    cdt = compute_dtype(device_type, cfg.train.compute_dtype)
    ms = MASTER_DTYPE.itemsize
    sharded = world > 1

    def rows(shapes_) -> tuple[int, int]:  # (padded elements FSDP2 allocates, unpadded local elements)
        if not sharded:
            n = sum(math.prod(s) for s in shapes_)
            return n, n
        padded_ = sum(_fsdp_padded(s, world) for s in shapes_)
        return padded_, sum((b - a) * math.prod(s[1:]) for s in shapes_ for a, b in [piece_rows(s, world, rank)])

    padded, local = rows(shapes)
    where = f"FSDP2 shard 1/{world}" if sharded else "full"
    trained = shapes
    held = padded  # the weights this rank holds (padded shards)
    if cfg.lora.enabled:  # frozen base: no gradient, no AdamW state; the adapters are all that trains
        from staleflow.train.lora import lora_shapes

        trained = lora_shapes(lm, cfg.lora)
        held = rows(shapes + trained)[0]
        plan.add("weights", held * ms, f"{MASTER_DTYPE} frozen base + LoRA rank {cfg.lora.rank} adapters, {where}")
        padded, local = rows(trained)
    else:
        plan.add("weights", padded * ms, f"{MASTER_DTYPE} master, {where}")
    plan.add("grads", padded * ms, "sharded, reduced after every micro-batch" if sharded else "full")
    plan.add("optimizer", 2 * local * ms + 4 * len(trained), "AdamW exp_avg + exp_avg_sq + step")
    if cfg.train.kl_coef > 0:
        plan.add("reference", rows(shapes)[0] * cdt.itemsize, f"KL reference in {cdt}, sharded like the policy")
    plan.add(
        "slots",
        slot_piece_bytes,
        "two Parameter Server slots' piece on this GPU"
        if device_type == "cuda"
        else "two Parameter Server slots (shared memory)",
    )

    sizes = [sum(p.numel() for p in layer.parameters()) for layer in lm.model.layers]
    layer_params = max(sizes)  # the largest layer (a sparse one in a mixture-of-experts model)
    root = total - sum(sizes)
    head = args.vocab_size * args.hidden_size
    tokens = max(cfg.train.micro_batch_tokens, cfg.rollout.max_model_len)
    kinds = {args.is_moe_layer(i): i for i in reversed(range(args.num_layers))}  # first layer of each kind
    saved = {s: _saved_once(args, tokens, cdt, not flash, i) for s, i in kinds.items()}
    per_layer = max(saved.values())
    x_bytes = tokens * args.hidden_size * cdt.itemsize
    ac = activation_checkpointing_on(cfg.train.activation_checkpointing, device_type)
    every = sum(saved[args.is_moe_layer(i)] for i in range(args.num_layers))
    acts = (args.num_layers * x_bytes + 2 * per_layer) if ac else every + per_layer
    impl = (
        cfg.train.logprob_impl
        if cfg.train.logprob_impl != "auto"
        else ("triton" if device_type == "cuda" else "chunked")
    )
    logprob = x_bytes  # the response rows' hidden states, kept for backward
    if impl == "chunked":
        chunk = max(1, DEFAULT_CHUNK_ELEMENTS // args.vocab_size) * args.vocab_size
        logprob += 2 * chunk * 4 + (head * 4 if device_type == "cuda" else 0)  # [C, V] z, exp; bf16 W in fp32
    elif impl == "naive":
        logprob += 3 * tokens * args.vocab_size * 4
    plan.add(
        "activations",
        acts + logprob,
        f"{tokens} tokens per micro-batch, activation checkpointing {'on' if ac else 'off'}, log-prob op {impl}",
    )
    if impl == "triton":
        inplace = addmm_out_dtype_inplace() if device_type == "cuda" else True
        plan.add(
            "logprob_bwd",
            logprob_backward_bytes(tokens, args.hidden_size, args.vocab_size, cdt, inplace_fp32_accumulate=inplace),
            "Triton log-prob backward: fp32 dW + dz chunk + "
            + ("dW in the weight dtype" if inplace else "the fp32 [V, H] product of each chunk (no in-place addmm)")
            + " (during backward)",
        )
    plan.add("optim_step", adamw_step_bytes(local), "AdamW foreach: sqrt(exp_avg_sq) per parameter (after backward)")
    if sharded:
        mp = mixed_precision(device_type)
        pdt = mp.param_dtype or MASTER_DTYPE
        rdt = mp.reduce_dtype or pdt
        gathered = (root + 2 * layer_params) * pdt.itemsize
        during_layers = layer_params * (pdt.itemsize + rdt.itemsize) + head * pdt.itemsize
        during_root = root * (pdt.itemsize + rdt.itemsize) - acts
        plan.add(
            "buffers",
            gathered + max(during_layers, during_root),
            "all-gathered root + 2 layers, one layer's unsharded grads (+ reduce-dtype copy)",
        )
    elif device_type == "cuda":
        plan.add("buffers", total * cdt.itemsize, "autocast's cached bf16 copies of the fp32 weights")
    if device_type == "cuda":
        plan.add("contexts", PRIMARY_CONTEXT_BYTES + (NCCL_BYTES if sharded else 0))
    # the lazy load (Trainer(..., weights=...)): the (sharded) weights allocated, then one full fp32
    # tensor at a time on the device, plus its rows that distribute_tensor cuts from it
    largest = max(math.prod(s) for s in shapes)
    plan.load_peak = held * ms + largest * ms + (_fsdp_padded(max(shapes, key=math.prod), world) * ms if sharded else 0)
    return plan.finish()


def engine_workspace(args, rollout_cfg, itemsize: int) -> int:
    """One engine step's largest live tensors (inference mode, one layer at a time): hidden and
    residual, q|k|v, attention output, gate|up and the SwiGLU product for the step's tokens, a
    prefill chunk's [n, L] mask, then fp32 logits and the sampler's [B, V] temporaries."""
    t = rollout_cfg.prefill_chunk_tokens + rollout_cfg.max_running
    h, d = args.hidden_size, args.head_dim
    per_token = 2 * h + (args.num_heads + 2 * args.num_kv_heads) * d + args.num_heads * d + mlp_per_token(args)
    mask = rollout_cfg.prefill_chunk_tokens * rollout_cfg.max_model_len
    sampler = 3 * rollout_cfg.max_running * args.vocab_size * 4
    return t * per_token * itemsize + mask + sampler


@dataclass
class RolloutSite:
    """One rollout rank as the memory plan sees it, handed to its engine backend's ``plan_rank``
    (staleflow.engines): the run's config, the model's shape, the rank, the device type, the rollout
    dtype (the slots' dtype), and the estimates that engines share."""

    cfg: object
    args: object
    rank: int
    device_type: str
    dtype: torch.dtype
    context_bytes: int = PRIMARY_CONTEXT_BYTES
    """The rank process's own CUDA context."""

    def new_plan(self) -> RankPlan:
        return RankPlan(self.rank, "rollout", None)

    def meta_model(self):
        """Our CausalLM on the meta device in the rollout dtype (projections not yet fused)."""
        return meta_model(self.args, self.dtype)

    @staticmethod
    def unique_bytes(params) -> int:
        return unique_bytes(params)

    def weights_bytes(self) -> int:
        """The policy's parameters in the rollout dtype (tied embeddings counted once)."""
        return unique_bytes(self.meta_model().parameters())

    def workspace_bytes(self) -> int:
        return engine_workspace(self.args, self.cfg.rollout, self.dtype.itemsize)

    def prefill_mask_bytes(self) -> int:
        rc = self.cfg.rollout
        return prefill_mask_bytes(self.args, rc.prefill_chunk_tokens, rc.max_model_len, self.dtype.itemsize)

    def graph_pool_bytes(self) -> int:
        return cuda_graph_pool_bytes(self.args, self.cfg.rollout, self.dtype.itemsize)

    def load_bytes(self, model=None) -> int:
        """A rank loading ``model`` (default: the meta model) in the rollout dtype, one tensor at a
        time read as fp32 at most: its parameters plus the largest tensor in fp32."""
        params = list((model or self.meta_model()).parameters())
        return sum(p.numel() for p in params) * self.dtype.itemsize + max(p.numel() for p in params) * 4


def rollout_rank(cfg, args, rank: int, device_type: str) -> RankPlan:
    """A rollout rank's plan, as its engine backend (--rollout.engine) describes it."""
    from staleflow.cluster.placement import slot_dtype
    from staleflow.engines import engine_backend

    site = RolloutSite(cfg, args, rank, device_type, slot_dtype(cfg, device_type))
    return engine_backend(cfg).plan_rank(site)
