"""CISPO: clip the importance-sampling WEIGHT, not the token update (MiniMax-M1, arXiv 2506.13585).

PPO-clip (``--train.loss grpo``) gives a token whose ratio left [1 - eps, 1 + eps] no gradient at all,
and those are often the rare tokens that matter (a "however" that starts a reflection). CISPO keeps
every token's gradient and bounds only its weight:

    J(theta) = 1 / sum_i |o_i| * sum_i sum_t sg(r_hat_it) * A_it * log pi_theta(o_it)
    r_hat_it = clip(r_it, 1 - eps_low, 1 + eps_high),   r_it = pi_theta(o_it) / pi_old(o_it)

sg is stop-gradient. The paper sets no lower bound in practice (a large eps_low) and tunes only
eps_high: here eps_high is ``--train.clip-high`` and there is no lower clip. The 1 / sum_i |o_i|
normaliser is ``--train.loss-agg token-mean``, which ``auto`` picks for this loss. pi_old is the
``logp_old`` that ``--train.off-policy`` chooses: with ``none`` it is the behaviour policy that
sampled the tokens, as in the paper, and r_hat is then the whole off-policy correction.

Run on the tiny preset from the repository root:

    PYTHONPATH=$PWD ./launch.sh --preset tiny --train.loss examples.cispo:cispo_loss --train.off-policy none
"""

from __future__ import annotations

import torch

from examples.calls import record
from staleflow.train.losses import LossInputs, LossSettings


def cispo_loss(s: LossSettings, x: LossInputs, logp_old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss [N], clipped [N] bool): -sg(min(r, 1 + clip_high)) * A * logp; the loss
    interface of ``--train.loss`` (staleflow.train.losses.LossFn)."""
    record("cispo_loss")
    ratio = torch.exp(x.logp.detach() - logp_old)  # [N] r_t, no gradient through it
    cap = 1.0 + s.clip_high
    return -ratio.clamp(max=cap) * x.advantages * x.logp, ratio > cap
