"""Policy losses, loss aggregation and off-policy correction for one packed micro-batch.

Three policies meet in asynchronous RL (AReaL's decoupled PPO vocabulary):
- behaviour mu: the (possibly stale, possibly engine-mismatched) weights that sampled a token;
  its log-prob comes from the rollout engine with the trajectory;
- proximal pi_prox: the trainer's weights at the start of this step, i.e. log-probs of a no-grad
  forward before any update (equal to pi_theta.detach() when the step makes one update);
- current pi_theta: the weights being optimised (with gradient).

Per token, with A the advantage, r = exp(logp - logp_old), and an importance weight w:

    ppo/grpo:       l = w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    gspo:           same with the sequence ratio s_i = exp(mean_t(logp - logp_old)) in place of r,
                    carried per token as exp(logp - sg(logp) + sg(log s_i)) (GSPO-token form)
    + kl_coef * KL(pi_theta || pi_ref) (k1 = logp - ref, k3 = exp(ref - logp) - (ref - logp) - 1)
    - entropy_coef * entropy

``--train.off-policy`` chooses logp_old and w (all weights are detached), rho_t = exp(prox_t - mu_t);
each is a registered function ``fn(settings, inputs) -> Correction`` (docs/extending.md):
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
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from staleflow.extensions import Registry, Shape

AGGREGATIONS = ("token-mean", "seq-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
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
        raise ValueError(
            f"loss_agg={loss_agg!r} is unknown: use auto or one of {list(AGGREGATIONS)} (--train.loss-agg)"
        )
    if loss == "gspo" and loss_agg in LENGTH_WEIGHTED:
        _warn_once(
            ("gspo", loss_agg),
            f"--train.loss gspo with --train.loss-agg {loss_agg}: GSPO's objective is a "
            "mean over sequences, and this aggregation weights each sequence by its length; use "
            "--train.loss-agg seq-mean (or auto) for GSPO as its paper defines it",
        )
    if advantage == "dr-grpo" and loss_agg != "seq-mean-token-sum-norm":
        _warn_once(
            ("dr-grpo", loss_agg),
            f"--train.advantage dr-grpo with --train.loss-agg {loss_agg}: this drops "
            "only the std normalisation; Dr. GRPO also normalises the loss by a constant, use "
            "--train.loss-agg seq-mean-token-sum-norm (or auto)",
        )
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
        raise ValueError(
            f"loss_agg='seq-mean-token-sum-norm' (Dr. GRPO) normalises by the maximum response length, "
            f"got max_response_tokens={max_response_tokens!r}: pass the run's --rollout.max-new-tokens"
        )
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
    """One micro-batch's response tokens, flattened over its sequences ([N] tensors): everything a
    loss or an off-policy correction may rely on."""

    logp: torch.Tensor
    """Current policy log-probs (with gradient)."""
    behaviour_logp: torch.Tensor
    """Log-probs of the weights that sampled each token (from the rollout engine)."""
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
    """The loss-related knobs of TrainConfig, validated once: the loss and the off-policy correction
    are resolved through their registries here (a registered name or 'package.module:name')."""

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
    loss_fn: LossFn = field(init=False, repr=False, compare=False)
    """The function --train.loss names."""
    correction: OffPolicyFn = field(init=False, repr=False, compare=False)
    """The function --train.off-policy names."""
    recompute_proximal: bool = field(init=False, repr=False, compare=False)
    """The correction asks for a separate no-grad proximal forward (its ``recompute_proximal`` attribute)."""

    def __post_init__(self):
        object.__setattr__(self, "loss_fn", LOSSES.resolve(self.loss))
        object.__setattr__(self, "correction", OFF_POLICIES.resolve(self.off_policy))
        object.__setattr__(self, "recompute_proximal", getattr(self.correction, "recompute_proximal", False))
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator={self.kl_estimator!r} is unknown: use k1 or k3")

    @classmethod
    def from_config(cls, cfg) -> LossSettings:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if f.init})


# ---- off-policy corrections ------------------------------------------------------------------
@dataclass
class Correction:
    """What an off-policy correction gives the loss for one micro-batch ([N] tensors, detached)."""

    logp_old: torch.Tensor
    """The ratio's reference log-probs: behaviour_logp or proximal_logp."""
    weight: torch.Tensor
    """w: multiplies each token's loss."""
    truncated: torch.Tensor
    """bool: w was capped (metrics: is_truncated_frac)."""
    rejected: torch.Tensor
    """bool: w was masked to 0 (metrics: is_masked_frac)."""


OffPolicyFn = Callable[[LossSettings, LossInputs], Correction]
OFF_POLICIES: Registry[OffPolicyFn] = Registry(
    "off-policy correction",
    "--train.off-policy",
    Shape.function(
        2,
        "fn(settings, inputs) -> Correction(logp_old, weight, truncated, rejected), with an optional "
        "bool attribute recompute_proximal",
        optional=(("recompute_proximal", bool),),
    ),
)
register_off_policy = OFF_POLICIES.register


def _log_rho(x: LossInputs) -> torch.Tensor:
    return (x.proximal_logp - x.behaviour_logp).detach()  # [N]


def _seq_sum(v: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """Each token's sequence total of v ([N] -> [N]): the log of a product over the sequence."""
    return segment_sum(v, x.seq_index, x.num_seqs)[x.seq_index]


def _truncated(s: LossSettings, x: LossInputs, log_rho: torch.Tensor) -> Correction:
    rho = torch.exp(log_rho)
    return Correction(
        x.proximal_logp.detach(), rho.clamp(max=s.is_cap), rho > s.is_cap, torch.zeros_like(rho, dtype=torch.bool)
    )


def _masked(s: LossSettings, x: LossInputs, log_rho: torch.Tensor) -> Correction:
    rho = torch.exp(log_rho)
    rejected = (rho < s.is_low) | (rho > s.is_high)
    return Correction(
        x.proximal_logp.detach(),
        torch.where(rejected, torch.zeros_like(rho), rho),
        torch.zeros_like(rejected),
        rejected,
    )


@register_off_policy("none")
def no_correction(s: LossSettings, x: LossInputs) -> Correction:
    none = torch.zeros_like(x.behaviour_logp, dtype=torch.bool)
    return Correction(x.behaviour_logp.detach(), torch.ones_like(x.behaviour_logp).detach(), none, none)


@register_off_policy("tis-token")
def tis_token(s: LossSettings, x: LossInputs) -> Correction:
    return _truncated(s, x, _log_rho(x))


@register_off_policy("tis-seq")
def tis_seq(s: LossSettings, x: LossInputs) -> Correction:
    return _truncated(s, x, _seq_sum(_log_rho(x), x))  # sequence product


@register_off_policy("mis-token")
def mis_token(s: LossSettings, x: LossInputs) -> Correction:
    return _masked(s, x, _log_rho(x))


@register_off_policy("mis-seq")
def mis_seq(s: LossSettings, x: LossInputs) -> Correction:
    return _masked(s, x, _seq_sum(_log_rho(x), x))  # sequence product


@register_off_policy("mis-seq-geo")
def mis_seq_geo(s: LossSettings, x: LossInputs) -> Correction:
    log_rho = _log_rho(x)
    count = _seq_sum(torch.ones_like(log_rho), x).clamp(min=1)
    return _masked(s, x, _seq_sum(log_rho, x) / count)  # geometric mean


def decoupled(s: LossSettings, x: LossInputs) -> Correction:
    """tis-token against proximal log-probs that always come from their own no-grad forward."""
    return tis_token(s, x)


decoupled.recompute_proximal = True
register_off_policy("decoupled")(decoupled)
OFF_POLICY = tuple(OFF_POLICIES)
"""The built-in off-policy corrections' names."""


def importance_weights(s: LossSettings, x: LossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w [N], truncated [N] bool, rejected [N] bool): detached behaviour-correction weights."""
    c = s.correction(s, x)
    return c.weight, c.truncated, c.rejected


# ---- policy losses ---------------------------------------------------------------------------
LossFn = Callable[[LossSettings, LossInputs, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
LOSSES: Registry[LossFn] = Registry(
    "loss",
    "--train.loss",
    Shape.function(3, "fn(settings, inputs, logp_old) -> (per-token loss [N], clipped [N] bool)"),
)
register_loss = LOSSES.register
"""Decorator: fn(settings, inputs, logp_old) -> (per-token loss [N], clipped [N] bool)."""


def _clip_objective(s: LossSettings, ratio: torch.Tensor, adv: torch.Tensor):
    pg = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    return torch.maximum(pg, pg_clipped), pg_clipped > pg


@register_loss("ppo")
@register_loss("grpo")
def ppo_clip(s: LossSettings, x: LossInputs, logp_old: torch.Tensor):
    """Token-level PPO-clip (DAPO's clip-higher is --train.clip-high 0.28: --preset dapo, docs/recipes.md)."""
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
    c = s.correction(s, x)
    _check_output(s.off_policy, "--train.off-policy", "weight", c.weight, x)
    per_token, clipped = s.loss_fn(s, x, c.logp_old.detach())
    _check_output(s.loss, "--train.loss", "per-token loss", per_token, x)
    per_token = per_token * c.weight.detach()
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
            "is_weight": c.weight.float().sum(),
            "is_ratio": rho.sum(),
            "is_ratio_max": rho.max() if n else -big,
            "is_ratio_min": rho.min() if n else big,
            "is_truncated_frac": c.truncated.float().sum(),
            "is_masked_frac": c.rejected.float().sum(),
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


def _check_output(spec: str, flag: str, what: str, value, x: LossInputs) -> None:
    """A fork's loss or correction must give one value per token; say which flag's function did not."""
    if not isinstance(value, torch.Tensor) or value.shape != x.logp.shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{flag}={spec!r} returned a {what} of shape {got}; it must be one value per token, "
            f"shape {tuple(x.logp.shape)}"
        )
