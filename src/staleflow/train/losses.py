"""Policy losses, loss aggregation and off-policy correction for one packed micro-batch.

Three policies meet in asynchronous RL (AReaL's decoupled PPO vocabulary):
- behaviour mu: the (possibly stale, possibly engine-mismatched) weights that sampled a token;
  its log-prob comes from the rollout engine with the trajectory;
- proximal pi_prox: the trainer's weights at the start of this step, i.e. log-probs of a no-grad
  forward before any update (equal to pi_theta.detach() when the step makes one update);
- current pi_theta: the weights being optimised (with gradient).

Per token, with A the advantage, r = exp(logp - logp_old), and an importance weight w:

    ppo/grpo/dapo:  l = w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    gspo:           same with the sequence ratio s_i = exp(mean_t(logp - logp_old)) in place of r,
                    carried per token as exp(logp - sg(logp) + sg(log s_i)) (GSPO-token form)
    + kl_coef * KL(pi_theta || pi_ref) (k1 = logp - ref, k3 = exp(ref - logp) - (ref - logp) - 1)
    - entropy_coef * entropy

``--train.off-policy`` chooses logp_old and w (all weights are detached), rho_t = exp(prox_t - mu_t):
- none:        logp_old = behaviour, w = 1 (naive PPO against the sampler);
- tis-token:   logp_old = proximal, w = min(rho_t, is_cap) per token;
- tis-seq:     w = min(prod_t rho_t, is_cap) per sequence (PRODUCT: the sequence's likelihood ratio);
- mis-token:   w = rho_t * 1[is_low <= rho_t <= is_high] (masked IS, IcePop-style);
- mis-seq:     the same per sequence with the PRODUCT prod_t rho_t = exp(sum_t log rho_t)
               (verl seq-mis, TRL sequence_mask);
- mis-seq-geo: the same with the GEOMETRIC MEAN exp(mean_t log rho_t) (verl's "geometric" rejection;
               it does not grow with length, so it needs much tighter bounds to reject anything);
- decoupled:   as tis-token, and the trainer always recomputes the proximal log-probs with a
               separate no-grad forward before the update (AReaL's decoupled PPO).
When behaviour == proximal every weight is exactly 1. A masked token or sequence still counts in
the aggregation's denominator (IcePop's objective; verl drops rejected ones from it).

Aggregation (``--train.loss-agg``) is done by per-token weights that already hold the GLOBAL
normalisation of the whole mini-batch (`token_weights`), so summing micro-batch losses over
micro-batches and ranks gives the same loss and gradient whatever the split. With S sequences
(ALL of them, empty completions included) and L_i response tokens each:

    token-mean               sum_i sum_t l / sum_i L_i      DAPO; TRL "dapo"; verl "token-mean"
    seq-mean                 1/S sum_i (1/L_i) sum_t l       GRPO, GSPO; TRL "grpo"; verl "seq-mean-token-mean"
    seq-mean-token-sum       1/S sum_i sum_t l               verl "seq-mean-token-sum"
    seq-mean-token-sum-norm  1/(S L_max) sum_i sum_t l       Dr. GRPO; TRL "dr_grpo"; verl "seq-mean-token-sum-norm"

L_max is a constant, the run's maximum response length (``--rollout.max-new-tokens``), so a
Dr. GRPO token's weight does not depend on the lengths of the other completions. An empty
completion adds nothing to a token count but is one of the S sampled completions, as in the
papers' 1/G and TRL's mean over the batch (verl leaves fully-masked rows out of S).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

AGGREGATIONS = ("token-mean", "seq-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
OFF_POLICY = ("none", "tis-token", "tis-seq", "mis-token", "mis-seq", "mis-seq-geo", "decoupled")
LENGTH_WEIGHTED = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""Aggregations under which a sequence's share of the loss grows with its length."""
_warned: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def resolve_loss_agg(loss: str, advantage: str, loss_agg: str) -> str:
    """The aggregation a run uses: ``auto`` follows the loss's / estimator's paper, anything else is kept.

    auto: gspo -> seq-mean (the GSPO objective is a mean over sequences); advantage dr-grpo ->
    seq-mean-token-sum-norm (Dr. GRPO's constant normaliser); otherwise token-mean. An explicit
    choice that departs from the paper warns once per process (the run goes on as asked):
    gspo with a length-weighted aggregation, dr-grpo with anything but seq-mean-token-sum-norm.
    """
    if loss_agg == "auto":
        if loss == "gspo":
            return "seq-mean"
        return "seq-mean-token-sum-norm" if advantage == "dr-grpo" else "token-mean"
    if loss_agg not in AGGREGATIONS:
        raise ValueError(f"loss_agg={loss_agg!r} is unknown: use auto or one of {list(AGGREGATIONS)} "
                         "(--train.loss-agg)")
    if loss == "gspo" and loss_agg in LENGTH_WEIGHTED:
        _warn_once(("gspo", loss_agg), f"--train.loss gspo with --train.loss-agg {loss_agg}: GSPO's objective is a "
                   "mean over sequences, and this aggregation weights each sequence by its length; use "
                   "--train.loss-agg seq-mean (or auto) for GSPO as its paper defines it")
    if advantage == "dr-grpo" and loss_agg != "seq-mean-token-sum-norm":
        _warn_once(("dr-grpo", loss_agg), f"--train.advantage dr-grpo with --train.loss-agg {loss_agg}: this drops "
                   "only the std normalisation; Dr. GRPO also normalises the loss by a constant, use "
                   "--train.loss-agg seq-mean-token-sum-norm (or auto)")
    return loss_agg


def token_weights(agg: str, lengths: list[int], max_response_tokens: int | None = None) -> list[float]:
    """Per-sequence weight of each of its tokens so that sum(weight * l) is the aggregated loss.

    lengths are the response lengths of ALL sequences of the mini-batch, empty ones included:
    S = len(lengths) (see the module docstring). token-mean: 1 / total_tokens; seq-mean:
    1 / (S * L_i); seq-mean-token-sum: 1 / S; seq-mean-token-sum-norm: 1 / (S * max_response_tokens).
    No response token at all: every weight is 0 (no loss, no NaN).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"loss_agg={agg!r} is unknown: use one of {list(AGGREGATIONS)} (--train.loss-agg)")
    if agg == "seq-mean-token-sum-norm" and not (max_response_tokens and max_response_tokens >= 1):
        raise ValueError(f"loss_agg='seq-mean-token-sum-norm' (Dr. GRPO) normalises by the maximum response length, "
                         f"got max_response_tokens={max_response_tokens!r}: pass the run's --rollout.max-new-tokens")
    total = sum(lengths)
    seqs = len(lengths)
    if total == 0:
        return [0.0] * seqs
    if agg == "token-mean":
        return [1.0 / total] * seqs
    if agg == "seq-mean":
        return [1.0 / (seqs * n) if n > 0 else 0.0 for n in lengths]
    if agg == "seq-mean-token-sum":
        return [1.0 / seqs] * seqs
    return [1.0 / (seqs * max_response_tokens)] * seqs


def segment_sum(x: torch.Tensor, seg: torch.Tensor, num_segments: int) -> torch.Tensor:
    """[N] values, [N] segment ids in [0, S) -> [S] per-segment sums."""
    return torch.zeros(num_segments, dtype=x.dtype, device=x.device).index_add_(0, seg, x)


@dataclass
class LossInputs:
    """One micro-batch's response tokens, flattened over its sequences ([N] tensors)."""

    logp: torch.Tensor
    """Current policy log-probs (with gradient)."""
    behaviour_logp: torch.Tensor
    proximal_logp: torch.Tensor
    """No-grad log-probs of the weights at the start of the step."""
    advantages: torch.Tensor
    token_weight: torch.Tensor
    """Aggregation weight with the global normalisation (`token_weights`)."""
    seq_index: torch.Tensor
    """int64 [N]: which sequence (0..num_seqs-1 within the micro-batch) a token belongs to."""
    num_seqs: int
    entropy: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


@dataclass(frozen=True)
class LossSettings:
    """The loss-related knobs of TrainConfig, validated once."""

    loss: str = "grpo"
    off_policy: str = "tis-token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r} is unknown: use one of {sorted(LOSSES)} (--train.loss)")
        if self.off_policy not in OFF_POLICY:
            raise ValueError(f"off_policy={self.off_policy!r} is unknown: use one of {list(OFF_POLICY)}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator={self.kl_estimator!r} is unknown: use k1 or k3")

    @classmethod
    def from_config(cls, cfg) -> "LossSettings":
        return cls(**{f: getattr(cfg, f) for f in cls.__dataclass_fields__})


def importance_weights(s: LossSettings, x: LossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w [N], truncated [N] bool, rejected [N] bool): detached behaviour-correction weights."""
    log_rho = (x.proximal_logp - x.behaviour_logp).detach()  # [N]
    none = torch.zeros_like(log_rho, dtype=torch.bool)
    if s.off_policy == "none":
        return torch.ones_like(log_rho), none, none
    if s.off_policy in ("tis-token", "decoupled", "tis-seq"):
        if s.off_policy == "tis-seq":
            log_rho = segment_sum(log_rho, x.seq_index, x.num_seqs)[x.seq_index]  # sequence product
        rho = torch.exp(log_rho)
        return rho.clamp(max=s.is_cap), rho > s.is_cap, none
    if s.off_policy == "mis-seq":
        log_rho = segment_sum(log_rho, x.seq_index, x.num_seqs)[x.seq_index]  # sequence product
    elif s.off_policy == "mis-seq-geo":
        count = segment_sum(torch.ones_like(log_rho), x.seq_index, x.num_seqs).clamp(min=1)
        log_rho = (segment_sum(log_rho, x.seq_index, x.num_seqs) / count)[x.seq_index]  # geometric mean
    rho = torch.exp(log_rho)
    rejected = (rho < s.is_low) | (rho > s.is_high)
    return torch.where(rejected, torch.zeros_like(rho), rho), none, rejected


LossFn = Callable[[LossSettings, LossInputs, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str):
    """Decorator: fn(settings, inputs, logp_old) -> (per-token loss [N], clipped [N] bool)."""

    def deco(fn: LossFn) -> LossFn:
        LOSSES[name] = fn
        return fn

    return deco


def _clip_objective(s: LossSettings, ratio: torch.Tensor, adv: torch.Tensor):
    pg = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    return torch.maximum(pg, pg_clipped), pg_clipped > pg


@register_loss("ppo")
@register_loss("grpo")
@register_loss("dapo")
def ppo_clip(s: LossSettings, x: LossInputs, logp_old: torch.Tensor):
    """Token-level PPO-clip; dapo = the same with clip-higher (set --train.clip-high 0.28)."""
    return _clip_objective(s, torch.exp(x.logp - logp_old), x.advantages)


@register_loss("gspo")
def gspo(s: LossSettings, x: LossInputs, logp_old: torch.Tensor):
    """GSPO: length-normalised sequence ratio, clipped per sequence."""
    diff = x.logp - logp_old  # [N]
    count = segment_sum(torch.ones_like(diff), x.seq_index, x.num_seqs).clamp(min=1)
    log_s = (segment_sum(diff.detach(), x.seq_index, x.num_seqs) / count)[x.seq_index]  # [N]
    ratio = torch.exp(x.logp - x.logp.detach() + log_s)  # value s_i, gradient s_i * dlogp
    return _clip_objective(s, ratio, x.advantages)


def policy_loss(s: LossSettings, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss scalar, stats): loss = sum_t token_weight_t * l_t.

    stats hold token SUMS (divide by the step's token count for means) and, under *_max/_min
    keys, extremes; all detached fp32 scalars.
    """
    w, truncated, rejected = importance_weights(s, x)
    logp_old = x.behaviour_logp if s.off_policy == "none" else x.proximal_logp
    per_token, clipped = LOSSES[s.loss](s, x, logp_old.detach())
    per_token = per_token * w
    if s.kl_coef > 0:
        if x.ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs (ref_logp)")
        d = x.ref_logp.detach() - x.logp
        kl = -d if s.kl_estimator == "k1" else torch.exp(d) - d - 1.0
        per_token = per_token + s.kl_coef * kl
    if s.entropy_coef > 0:
        if x.entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - s.entropy_coef * x.entropy
    loss = (per_token * x.token_weight).sum()

    with torch.no_grad():
        gap = (x.proximal_logp - x.behaviour_logp).float()
        rho = torch.exp(gap)
        n = gap.numel()
        big = torch.tensor(float("inf"))
        stats = {
            "is_weight": w.float().sum(),
            "is_ratio": rho.sum(),
            "is_ratio_max": rho.max() if n else -big,
            "is_ratio_min": rho.min() if n else big,
            "is_truncated_frac": truncated.float().sum(),
            "is_masked_frac": rejected.float().sum(),
            "ppo_clipped_frac": clipped.float().sum(),
            "behaviour_gap_abs": gap.abs().sum(),
            "behaviour_k3": (rho - 1.0 - gap).sum(),  # estimates KL(mu || pi_prox) from mu's samples
            "logp": x.logp.detach().float().sum(),
        }
        if x.entropy is not None:
            stats["entropy"] = x.entropy.detach().float().sum()
        if x.ref_logp is not None:
            d = (x.ref_logp - x.logp.detach()).float()
            stats["ref_kl_k3"] = (torch.exp(d) - d - 1.0).sum()
    return loss, stats
