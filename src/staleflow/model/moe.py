"""Mixture of experts: Qwen3-MoE's sparse block over a packed token stream, its routing statistics
and the router's auxiliary (load-balancing) loss.

    block = SparseMoeBlock(args)            # model.layers.{i}.mlp in a qwen3_moe CausalLM
    y, stats = block(x)                     # x [T, H] -> y [T, H]; stats [2, E] (see below)
    aux = router_aux_loss(stats_of_layers, top_k)   # transformers' load_balancing_loss_func

Parameter names are the Hugging Face Hub's (one module per expert), so a checkpoint loads and
saves as it is on the Hub and the Parameter Server moves it name by name:

    model.layers.{i}.mlp.gate.weight                      [E, H]  router
    model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight [I, H]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight      [H, I]

(transformers >= 5 stacks the experts into 3-D tensors in memory and converts these names on load
and save; the folders are the same.)

Routing, step by step, as transformers' ``Qwen3MoeTopKRouter`` computes it:
1. router logits z = x W_gate^T  [T, E] in the compute dtype;
2. p = softmax(z) in float32;
3. the top-k values and experts of p per token (torch.topk);
4. with ``norm_topk_prob`` the k values are divided by their sum;
5. the weights are cast back to z's dtype; token t's output is sum_j w_tj * expert_{e_tj}(x_t),
   each expert a SwiGLU MLP: down(silu(gate(x)) * up(x)).

Tokens are sorted by expert once (one host sync per layer for the counts); each expert with tokens
runs one GEMM pair on its rows. While gradients are on, every expert also runs on its (possibly
empty) row block, so every expert weight is in the graph: FSDP2 reduce-scatters the gradients of
one unit as one flat buffer, and a rank on which an expert got no token would otherwise bring a
buffer of another size (a hang).

``stats`` [2, E] float32: row 0 the top-k assignments per expert (no gradient), row 1 the sum over
tokens of p (differentiable): what the auxiliary loss and the tokens-per-expert metric need, O(E)
per layer instead of the [T, E] router logits of every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExpertLinear(nn.Module):
    """A bias-free projection of one expert: ``weight`` [out, in] and F.linear, nothing else.
    nn.Linear's constructor costs ~0.5 ms (its initialisation, even on the meta device), and
    Qwen3-30B-A3B has 18,432 expert projections: the memory plan builds that model several times."""

    bias = None

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        if not self.weight.is_meta:  # a model built for real (not loaded): nn.Linear's initialisation
            nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _expert_linear(in_features: int, out_features: int, bias: bool = False) -> ExpertLinear:
    return ExpertLinear(in_features, out_features)


class Experts(nn.ModuleList):
    """The E expert MLPs of one layer (children ``0`` .. ``E-1``: the Hub's names). A module with a
    forward of its own, so FSDP2 can make it a unit of its own (train/parallelize.py)."""

    def forward(
        self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H], top_idx [T, k] expert ids, top_w [T, k] weights, counts [E] assignments per
        expert -> [T, H]."""
        k = top_idx.shape[1]
        order = torch.argsort(top_idx.reshape(-1), stable=True)  # [T k] assignments grouped by expert
        counts = _host_counts(counts, top_idx.numel())  # the one host sync
        token = order // k  # [T k] token of each sorted assignment
        rows = x[token]  # [T k, H]
        weight = top_w.reshape(-1)[order].unsqueeze(1)  # [T k, 1]
        train = torch.is_grad_enabled()
        outs = []
        start = 0
        for e, n in enumerate(counts):
            if n or train:
                outs.append(self[e](rows[start : start + n]))
            start += n
        y = torch.cat(outs) if outs else rows  # [T k, H] in sorted order
        out = torch.zeros_like(x)
        return out.index_add_(0, token, (y * weight).to(x.dtype))


class SparseMoeBlock(nn.Module):
    """Router (``gate``) + experts: the ``mlp`` of a sparse Qwen3-MoE layer."""

    def __init__(self, args, mlp_cls):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        inter = args.moe_intermediate_size
        self.experts = Experts(mlp_cls(args, inter, linear=_expert_linear) for _ in range(args.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (top-k weights [T, k] in x's dtype, expert ids [T, k], softmax probs [T, E] fp32)."""
        logits = F.linear(x, self.gate.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_idx, probs

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (y [T, H], stats [2, E]: assignments per expert, summed router probabilities)."""
        top_w, top_idx, probs = self.route(x)
        flat = top_idx.reshape(-1)
        counts = torch.zeros(probs.shape[1], dtype=torch.int64, device=x.device).index_add_(
            0, flat, torch.ones_like(flat)
        )  # [E] (bincount has no meta kernel: the memory plan runs this block on the meta device)
        y = self.experts(x, top_idx, top_w, counts)
        return y, torch.stack([counts.to(torch.float32), probs.sum(dim=0)])


def _host_counts(counts: torch.Tensor, assignments: int) -> list[int]:
    """Assignments per expert on the host; on the meta device (the memory plan counting the bytes a
    layer saves) an even split, the load a balanced router gives."""
    if counts.device.type == "meta":
        n = len(counts)
        return [assignments // n + (e < assignments % n) for e in range(n)]
    return counts.tolist()


def router_aux_loss(stats: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over every sparse layer, as transformers'
    ``load_balancing_loss_func`` computes it for one unpadded batch.

    stats [L, 2, E] (SparseMoeBlock's, stacked over the L sparse layers). With R = L T rows, f_e =
    (assignments to e) / R and P_e = (sum of p_e over the rows) / R: loss = E * sum_e f_e P_e, whose
    minimum k (f_e = k / E, P_e = 1 / E) means a uniform load. Only P carries a gradient."""
    counts, prob_sum = stats[:, 0].sum(0), stats[:, 1].sum(0)  # [E], [E]
    rows = counts.sum() / top_k  # R: every row makes k assignments
    num_experts = stats.shape[-1]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def expert_load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Tokens routed per expert, summarised: ``counts`` [L, E] assignments of a step (every sparse
    layer, every micro-batch, every trainer rank). Per (layer, expert): min / mean / max tokens, the
    imbalance max / mean (1 = uniform) and how many got no token at all."""
    counts = counts.double()
    mean = counts.mean().item()
    return {
        "moe_tokens_per_expert_min": counts.min().item(),
        "moe_tokens_per_expert_mean": mean,
        "moe_tokens_per_expert_max": counts.max().item(),
        "moe_load_imbalance": counts.amax(dim=1).div(counts.mean(dim=1).clamp_min(1e-9)).max().item()
        if mean > 0
        else 0.0,
        "moe_idle_experts": float((counts == 0).sum().item()),
    }
