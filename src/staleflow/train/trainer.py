"""Trainer: one optimisation step per Ready staleness buffer, FSDP2 over the trainer ranks.

    trainer = Trainer(model, cfg.train, device, process_group=trainer_group,
                      max_response_tokens=cfg.rollout.max_new_tokens)  # Dr. GRPO's constant normaliser
    metrics = trainer.step(groups, payloads) # buffer v's TrainGroups; per group its members' TrajectoryTokens
    for shard in trainer.named_shards(): ... # this rank's own parameter shards -> Parameter Server
    full = trainer.full_state_dict(rank0_only=True)  # collective; the full fp32 state on rank 0 only

Every trainer rank must be passed the SAME groups and payloads (same order): the plan (who trains
what) is computed identically on every rank, with no communication. Steps of `step`:

1. validate the payloads against their groups and flatten them (`batch.step_payloads`: member k
   of the step is the k-th payload, group after group); add DAPO overlong shaping to rewards;
   optionally drop groups with all-equal rewards (dynamic sampling); compute group advantages
   (``--train.advantage``);
2. split the kept groups into ``mini_batches`` mini-batches; for each, plan micro-batches
   (`packing.plan_step`: Karmarkar-Karp across ranks, FFD under the token budget, equal counts
   per rank) and per-token loss weights normalised by the mini-batch's GLOBAL token/sequence
   counts (``--train.loss-agg``, resolved once by `losses.resolve_loss_agg`; every sequence,
   empty ones included, counts in the sequence count);
3. if the proximal policy can differ from the current one (decoupled PPO, or more than one
   mini-batch) recompute proximal log-probs with a no-grad forward; else use the current
   log-probs detached. Reference log-probs (KL) come from a frozen, sharded copy of the initial
   weights in the compute dtype (bf16 on CUDA: what the policy's forward sees anyway);
4. per mini-batch: forward + backward each micro-batch, each backward reduce-scattering its
   gradients into the sharded fp32 gradients (no unsharded gradient is kept across
   micro-batches: +4 bytes per parameter per rank otherwise), clip the global grad norm, AdamW
   update; then advance the LR schedule and the version.

Gradients equal those of the global loss whatever the split: each micro-batch's loss is a
sum with globally normalised weights, and FSDP's mean over ranks is undone by scaling the
loss by the world size. On CUDA, FSDP2 keeps fp32 sharded master weights (MASTER_DTYPE) and
computes in bf16 with fp32 gradient reduction (``mixed_precision``); a single rank without a
process group uses bf16 autocast, the LM head included. Activation checkpointing follows
``--train.activation-checkpointing`` (auto: on for CUDA). The memory plan (staleflow.plan)
reads these same definitions.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from staleflow.train.advantages import ADVANTAGES, compute_advantages, groups_with_signal, overlong_penalty
from staleflow.train.batch import MicroBatch, build_micro_batch, member_groups, step_payloads
from staleflow.train.lora import apply_lora, lora_init, lora_shards
from staleflow.train.losses import LossInputs, LossSettings, policy_loss, resolve_loss_agg, token_weights
from staleflow.train.packing import plan_step
from staleflow.train.parallelize import (
    MASTER_DTYPE,
    Replicas,
    activation_checkpointing_on,
    compute_dtype,
    fill_parameters,
    shard_policy,
    trainer_mesh,
)
from staleflow.train.policy import ParamShard, PolicyHead, head_operands  # noqa: F401 - part of this module's API
from staleflow.train.router import RouterTally
from staleflow.train.step_metrics import step_metrics
from staleflow.trajectory import TrainGroup, TrajectoryTokens


def lr_factor(step: int, warmup: int, schedule: str, total_steps: int | None) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based): linear warmup, then constant or cosine to 0."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, (total_steps or 0) - warmup)
    progress = min(1.0, (step - warmup) / span)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """FSDP2 trainer over `process_group` (None: a single, unsharded rank)."""

    def __init__(
        self,
        model: nn.Module,
        cfg,
        device: str | torch.device = "cpu",
        process_group=None,
        temperature: float = 1.0,
        total_steps: int | None = None,
        max_response_tokens: int | None = None,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        lora=None,
        replicas: Replicas | None = None,
    ):
        """max_response_tokens: the run's --rollout.max-new-tokens, the constant that Dr. GRPO
        (--train.loss-agg seq-mean-token-sum-norm) divides by; the other aggregations ignore it.

        A model on the meta device comes with ``weights``, (name, full tensor) pairs streamed one at
        a time (staleflow.model.lazy_model): it is sharded first and each rank keeps only its own
        rows, so no rank holds the whole fp32 model (the load peak is the shard plus one tensor).

        ``lora`` (the run's LoraConfig): with a rank > 0, adapters go on its target projections and
        only they are trained, checkpointed and (merged into their projections) pushed (train/lora.py).

        ``replicas`` (HSDP, train/parallelize.Replicas): shard within each row of the mesh, replicate
        across rows; the loss is normalised over the whole ``process_group`` either way."""
        if cfg.schedule == "cosine" and not total_steps:
            raise ValueError("--train.schedule cosine needs the run length: pass total_steps (the run's --steps)")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is invalid: must match the sampler's and be > 0")
        self.cfg = cfg
        self.loss_settings = LossSettings.from_config(cfg)
        self.advantage_fn = ADVANTAGES.resolve(cfg.advantage)  # a registered name or an import path, once
        self.loss_agg = resolve_loss_agg(cfg.loss, cfg.advantage, cfg.loss_agg)
        self.max_response_tokens = max_response_tokens
        token_weights(self.loss_agg, [], max_response_tokens)  # a missing Dr. GRPO constant fails here
        self.device = torch.device(device)
        self.group = process_group
        self.world = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.replicas = replicas
        self.replica, self.shard_rank = replicas.coords(dist.get_rank()) if replicas is not None else (0, self.rank)
        self.shard_world = len(replicas.rows[0]) if replicas is not None else self.world
        """This rank's replica and its chunk of every dim-0-sharded tensor among ``shard_world`` (FSDP:
        replica 0, its rank among all trainer ranks)."""
        self.temperature = float(temperature)
        self.total_steps = total_steps
        self.version = 0
        self.optimizer_steps = 0
        self.forwards = 0
        """Micro-batch forwards run so far (the rank's pulse reports it as progress)."""

        lazy = any(p.is_meta for p in model.parameters())
        if lazy and weights is None:
            raise ValueError(
                "a model on the meta device needs its weights: pass weights=... (staleflow.model.lazy_model gives both)"
            )
        if weights is not None and not lazy:
            raise ValueError(
                "weights=... fills a model built on the meta device; this model is already loaded: "
                "pass weights=None (or build it with staleflow.model.lazy_model)"
            )
        args = getattr(model, "args", None)
        self.router = RouterTally(cfg.router_aux_coef, args) if args is not None and args.is_moe else None
        """Routing statistics and the auxiliary loss of a mixture-of-experts policy (train/router.py)."""
        if cfg.router_aux_coef > 0 and self.router is None:
            raise ValueError(
                f"--train.router-aux-coef={cfg.router_aux_coef} weighs the router loss of a mixture-of-experts "
                f"model; this model has no experts: set it to 0"
            )
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:
            apply_lora(model, self.lora)  # base weights frozen; adapters on the base's device (meta when lazy)
        model.to(dtype=MASTER_DTYPE, **({} if lazy else {"device": self.device}))
        model.gradient_checkpointing = activation_checkpointing_on(cfg.activation_checkpointing, self.device.type)
        self.model = model
        self.policy = PolicyHead(model)
        self.sharded = process_group is not None
        if self.sharded:
            self._shard(self.policy)
        if lazy:
            self.policy.to_empty(device=self.device)
            fill_parameters(model, itertools.chain(weights, lora_init(model) if self.lora else ()), self.device)
        elif self.lora is not None:  # the same seeded adapters on every rank, however the model was loaded
            fill_parameters(model, lora_init(model), self.device, partial=True)
        self.ref_policy = self._reference() if cfg.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
            eps=1e-8,
            foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.schedule, total_steps)
        )

    # ---- setup -------------------------------------------------------------------------------
    def _shard(self, policy: PolicyHead) -> None:
        shard_policy(policy, trainer_mesh(self.group, self.device.type, self.replicas), self.device.type)

    def _reference(self) -> PolicyHead:
        """A frozen copy of the current weights for the KL term, in the compute dtype and sharded
        like the policy: built on the meta device, then filled shard by shard (never a full copy
        of the fp32 model, which a deepcopy before sharding would make on every rank)."""
        with torch.device("meta"):
            lm = type(self.model)(self.model.args).to(compute_dtype(self.device.type, self.cfg.compute_dtype))
        ref = PolicyHead(lm).requires_grad_(False)
        if self.sharded:
            self._shard(ref)
        ref.to_empty(device=self.device)
        params = dict(self.model.named_parameters())  # a LoRA policy has more: its adapters (zero at start)
        with torch.no_grad():
            for name, q in lm.named_parameters():
                p = params.get(name)
                if p is None:
                    raise RuntimeError(f"reference policy: the policy has no parameter {name!r}")
                src = p.to_local() if hasattr(p, "to_local") else p
                (q.to_local() if hasattr(q, "to_local") else q).copy_(src)
        return ref

    def _autocast(self):
        """CUDA: bf16 autocast for a single rank (FSDP2's mixed precision does it when sharded);
        CPU: bf16 autocast of the decoder only with --train.compute-dtype bfloat16."""
        bf16 = compute_dtype(self.device.type, self.cfg.compute_dtype) == torch.bfloat16
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and not self.sharded)
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def _forward(self, policy: PolicyHead, mb: MicroBatch):
        self.forwards += 1
        with self._autocast():
            return policy(mb, self.temperature, self.cfg.logprob_impl)

    # ---- the step ----------------------------------------------------------------------------
    def prepare(
        self, groups: Sequence[TrainGroup], payloads: Sequence[Sequence[TrajectoryTokens]]
    ) -> tuple[list[float], list[float], list[bool]]:
        """(shaped rewards, advantages, kept) per member of the step, in `step_payloads` order (pure
        bookkeeping, no forward)."""
        return self._prepare(groups, step_payloads(groups, payloads))

    def _prepare(
        self, groups: Sequence[TrainGroup], tokens: list[TrajectoryTokens]
    ) -> tuple[list[float], list[float], list[bool]]:
        cfg = self.cfg
        rewards = [
            float(r) + overlong_penalty(len(t.response_ids), cfg.overlong_max_tokens, cfg.overlong_cache_tokens)
            for r, t in zip((r for g in groups for r in g.rewards), tokens)
        ]
        group_of = member_groups(groups)
        keep = groups_with_signal(rewards, group_of) if cfg.dynamic_sampling else [True] * len(tokens)
        kept = [i for i in range(len(tokens)) if keep[i]]
        adv_kept = compute_advantages(
            cfg.advantage, [rewards[i] for i in kept], [group_of[i] for i in kept], self.advantage_fn
        )
        adv = [0.0] * len(tokens)
        for i, a in zip(kept, adv_kept):
            adv[i] = a
        return rewards, adv, keep

    def _mini_batches(self, group_of: list[int], keep: list[bool]) -> list[list[int]]:
        order: dict = {}
        for i, g in enumerate(group_of):
            if keep[i]:
                order.setdefault(g, []).append(i)
        groups = list(order.values())
        n = min(self.cfg.mini_batches, len(groups))
        return [[i for g in groups[k * len(groups) // n : (k + 1) * len(groups) // n] for i in g] for k in range(n)]

    def _plan(self, tokens: Sequence[TrajectoryTokens], ids: list[int], adv: list[float]) -> list[MicroBatch]:
        """This rank's micro-batches for mini-batch `ids` of the step's flattened payloads (same count on every rank)."""
        resp = [tokens[i].num_trained for i in ids]  # the model's tokens: the loss's rows
        weights = token_weights(self.loss_agg, resp, self.max_response_tokens)
        seq_w = [0.0] * len(tokens)
        for i, w in zip(ids, weights):
            seq_w[i] = w
        lengths = [tokens[i].seq_len if r > 0 else 0 for i, r in zip(ids, resp)]
        plan = plan_step(lengths, self.world, self.cfg.micro_batch_tokens)
        self._oversize += len(plan.oversize)
        self._plan_tokens = max(sum(lengths), 1)  # the mini-batch's packed tokens, every rank together
        return [
            build_micro_batch(tokens, [ids[j] for j in mb], adv, seq_w).to(self.device) for mb in plan.ranks[self.rank]
        ]

    @torch.no_grad()
    def _logprobs_nograd(self, policy: PolicyHead, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        return [self._forward(policy, mb)[0].float() for mb in mbs]

    def step(self, groups: Sequence[TrainGroup], payloads: Sequence[Sequence[TrajectoryTokens]]) -> dict[str, float]:
        """One optimisation step on a Ready buffer: its groups and, per group, its members' payloads in
        ``traj_ids`` order; returns metrics (identical on every rank)."""
        t0 = time.perf_counter()
        self._oversize = 0
        tokens = step_payloads(groups, payloads)
        rewards, adv, keep = self._prepare(groups, tokens)
        minis = [m for m in self._mini_batches(member_groups(groups), keep) if m]
        planned, mini_tokens = [], []  # the same on every rank
        for ids in minis:
            mbs = self._plan(tokens, ids, adv)
            if mbs:
                planned.append(mbs)
                mini_tokens.append(self._plan_tokens)
        recompute = self.loss_settings.recompute_proximal or len(planned) > 1
        proximal = [self._logprobs_nograd(self.policy, mbs) for mbs in planned] if recompute else None
        ref = [self._logprobs_nograd(self.ref_policy, mbs) for mbs in planned] if self.ref_policy else None

        sums: dict[str, torch.Tensor] = {}
        self.policy.train()
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        grad_norms = []
        if self.router is not None:
            self.router.start_step()
        for k, mbs in enumerate(planned):
            self.optimizer.zero_grad(set_to_none=True)
            for m, mb in enumerate(mbs):
                logp, entropy = self._forward(self.policy, mb)
                x = LossInputs(
                    logp=logp,
                    behaviour_logp=mb.behaviour_logp,
                    proximal_logp=proximal[k][m] if recompute else logp.detach(),
                    advantages=mb.advantages,
                    token_weight=mb.token_weight,
                    seq_index=mb.seq_index,
                    num_seqs=max(mb.num_seqs, 1),
                    entropy=entropy,
                    ref_logp=ref[k][m] if ref else None,
                )
                loss, stats = policy_loss(self.loss_settings, x)
                aux = 0.0
                if self.router is not None and mb.rows.numel():  # a padding micro-batch routes nothing of its own
                    aux = self.router.add(self.policy.router_stats, mb.input_ids.numel() / mini_tokens[k])
                ((loss + aux) * self.world).backward()
                loss_total += loss.detach().double()
                for key, v in stats.items():
                    v = v.detach().double()  # stays on the device: one transfer per step, in _metrics
                    if key.endswith("_max"):
                        sums[key] = torch.maximum(sums[key], v) if key in sums else v
                    elif key.endswith("_min"):
                        sums[key] = torch.minimum(sums[key], v) if key in sums else v
                    else:
                        sums[key] = sums.get(key, 0.0) + v
            grad_norms.append(self._clip_and_step())
            if self.router is not None:
                self.router.end_update()
        if planned:
            self.scheduler.step()
        self.version += 1
        out = step_metrics(self, groups, tokens, rewards, adv, keep, sums, loss_total, grad_norms, t0)
        if self.router is not None:
            out.update(self.router.metrics(self.device, self.group if self.sharded else None))
        return out

    def _clip_and_step(self) -> float:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer_steps += 1
        return float(norm)

    # ---- weights out ----------------------------------------------------------------------------
    def named_shards(self) -> Iterator[ParamShard]:
        """This rank's own piece of every parameter (HF names), without any communication.

        FSDP2 shards dim 0 in torch.chunk fashion: shard s holds rows [s*c, min((s+1)*c, n)) with
        c = ceil(n / shard_world) (FSDP: s is the rank; HSDP: its index within its node, every node
        holding a replica). Unsharded training yields full tensors at offset 0. With LoRA: the
        merged weights of the adapted projections only (``pushed``; a collective: each adapter's A
        is gathered), nothing else changes.
        """
        if self.lora is not None:
            yield from (ParamShard(*s) for s in lora_shards(self.model, self.shard_rank, self.shard_world))
            return
        for name, p in self.model.named_parameters():
            if hasattr(p, "to_local"):
                local = p.to_local()
                n = p.shape[0]
                c = -(-n // self.shard_world)
                yield ParamShard(name, local.detach(), min(self.shard_rank * c, n), tuple(p.shape))
            else:
                yield ParamShard(name, p.detach(), 0, tuple(p.shape))

    def pushed(self) -> list[tuple[str, torch.Tensor]]:
        """(name, meta tensor of its full shape and master dtype) of what ``named_shards`` yields: the
        Parameter Server's layout. Every parameter, or with LoRA the adapted projections' weights."""
        if self.lora is not None:
            names = [f"{m}.weight" for m in self.model.lora_modules]
            params = dict(self.model.named_parameters())
            return [(n, torch.empty(tuple(params[n].shape), dtype=MASTER_DTYPE, device="meta")) for n in names]
        return [
            (n, torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")) for n, p in self.model.named_parameters()
        ]

    def full_state_dict(
        self, to_cpu: bool = True, rank0_only: bool = False, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Full (unsharded) HF-named state dict; a collective when sharded. Parameters are gathered
        one at a time; with ``rank0_only`` the other ranks drop each one at once (they return {}),
        so only rank 0 ever holds the whole model. ``dtype`` casts floating tensors (before the copy
        to the CPU)."""
        out = {}
        for name, t in self.model.state_dict().items():
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            if rank0_only and self.rank != 0:
                continue
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[name] = t.cpu() if to_cpu else t
        return out
