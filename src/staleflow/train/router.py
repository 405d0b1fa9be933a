"""The trainer's view of a mixture-of-experts policy: the router's auxiliary loss (--train.router-aux-coef)
and the tokens routed per expert, tallied over a step's micro-batches and trainer ranks.

    tally = RouterTally(cfg.router_aux_coef, model.args)   # None-free only for a MoE model
    tally.start_step()
    loss = loss + tally.add(policy.router_stats, share)   # per micro-batch, after its forward
    metrics.update(tally.metrics(device, group))          # collective when sharded

The auxiliary loss of a micro-batch is transformers' load-balancing loss over its tokens
(model/moe.py ``router_aux_loss``); the step's is the token-weighted mean over every micro-batch of
every rank (``share`` = the micro-batch's packed tokens / the mini-batch's, all ranks together), so
it does not depend on how the step was cut into micro-batches beyond the per-micro-batch statistics
(as in Megatron, which also balances per micro-batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from staleflow.model.moe import expert_load_metrics, router_aux_loss


class RouterTally:
    def __init__(self, coef: float, args):
        self.coef = float(coef)
        self.top_k = args.num_experts_per_tok
        self.shape = (sum(args.is_moe_layer(i) for i in range(args.num_layers)), args.num_experts)
        self.counts: torch.Tensor | None = None
        self.aux = 0.0
        self.updates = 0

    def start_step(self) -> None:
        self.counts, self.aux, self.updates = None, 0.0, 0

    def end_update(self) -> None:
        """One optimizer update (mini-batch) done: its auxiliary losses form one mean."""
        self.updates += 1

    def add(self, stats: torch.Tensor | None, share: float) -> torch.Tensor | float:
        """Tally one micro-batch's router stats [L, 2, E]; returns the term to add to its loss (0.0
        when the coefficient is 0: the gradient is then the policy loss's alone)."""
        if stats is None:
            return 0.0
        counts = stats[:, 0].detach()
        self.counts = counts if self.counts is None else self.counts + counts
        aux = router_aux_loss(stats, self.top_k) * share
        self.aux = self.aux + aux.detach().double()  # stays on the device: one transfer per step
        return self.coef * aux if self.coef > 0 else 0.0

    def metrics(self, device, group=None) -> dict[str, float]:
        """Tokens per expert and the auxiliary loss of the step, summed over the trainer ranks."""
        counts = self.counts if self.counts is not None else torch.zeros(self.shape)
        aux = torch.as_tensor(self.aux, dtype=torch.float64, device=device).reshape(1)
        vec = torch.cat([counts.reshape(-1).to(device, torch.float64), aux])
        if group is not None:
            dist.all_reduce(vec, group=group)
        out = expert_load_metrics(vec[:-1].reshape(self.shape).cpu())
        out["moe_aux_loss"] = float(vec[-1]) / max(self.updates, 1)
        return out
