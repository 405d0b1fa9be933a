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

``--train.off-policy`` chooses logp_old and w (all weights are detached):
- none:      logp_old = behaviour, w = 1 (naive PPO against the sampler);
- tis-token: logp_old = proximal, w = min(exp(prox - mu), is_cap) per token;
- tis-seq:   w = min(exp(sum_t(prox - mu)), is_cap) per sequence;
- mis-token: w = rho * 1[is_low <= rho <= is_high], rho = exp(prox - mu) (masked IS, IcePop-style);
- mis-seq:   same per sequence with the geometric-mean ratio exp(mean_t(prox - mu));
- decoupled: as tis-token, and the trainer always recomputes the proximal log-probs with a
  separate no-grad forward before the update (AReaL's decoupled PPO).
When behaviour == proximal every weight is exactly 1.

Aggregation is done by per-token weights that already hold the GLOBAL normalisation of the
whole step (`token_weights`), so summing micro-batch losses over micro-batches and ranks gives
the same loss and gradient whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

AGGREGATIONS = ("token-mean", "seq-mean", "seq-mean-token-sum")
OFF_POLICY = ("none", "tis-token", "tis-seq", "mis-token", "mis-seq", "decoupled")


def token_weights(agg: str, lengths: list[int]) -> list[float]:
    """Per-sequence weight of each of its tokens so that sum(weight * l) is the aggregated loss.

    lengths are the response lengths of ALL sequences of the step (zero-length ones count for
    nothing). token-mean: 1 / total_tokens; seq-mean: 1 / (num_seqs * L_i) (mean over sequences
    of per-sequence token means); seq-mean-token-sum: 1 / num_seqs (Dr. GRPO, no length norm).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"loss_agg={agg!r} is unknown: use one of {list(AGGREGATIONS)} (--train.loss-agg)")
    total = sum(lengths)
    seqs = sum(1 for n in lengths if n > 0)
    if total == 0:
        return [0.0] * len(lengths)
    if agg == "token-mean":
        return [1.0 / total] * len(lengths)
    if agg == "seq-mean":
        return [1.0 / (seqs * n) if n > 0 else 0.0 for n in lengths]
    return [1.0 / seqs] * len(lengths)


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
