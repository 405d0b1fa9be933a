"""The module the trainer optimises and FSDP2 wraps: the policy with its LM head's log-prob op in one
forward (``PolicyHead``), and what a trainer rank hands the Parameter Server (``ParamShard``).

    policy = PolicyHead(model)
    logp, entropy = policy(micro_batch, temperature, impl)   # [N], [N]; policy.router_stats (MoE)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from staleflow.model.attention import PackedAttention
from staleflow.train.batch import MicroBatch
from staleflow.train.logprobs import packed_logprobs


def head_operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head's inputs in autocast's dtype when autocast is on: the fp32 master LM head of a
    single CUDA rank would otherwise reach the log-prob kernel in fp32 (no tensor cores); the
    kernel still accumulates the logits in fp32."""
    dev = hidden.device.type
    if dev == "cuda" and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return hidden.to(dt), weight.to(dt)
    return hidden, weight


class PolicyHead(nn.Module):
    """CausalLM + packed log-prob op in one forward, so FSDP unshards the LM head around it.
    After a forward of a mixture-of-experts model, ``router_stats`` holds its sparse layers' routing
    statistics [L, 2, E] (model/moe.py; None for a dense model)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.router_stats: torch.Tensor | None = None

    def forward(self, mb: MicroBatch, temperature: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        attn = PackedAttention(mb.cu_seqlens)
        hidden, self.router_stats = self.lm(mb.input_ids, mb.positions, attn, router_stats=True)  # [T, H]
        rows, weight = head_operands(hidden[mb.rows], self.lm.lm_head_weight)  # [N, H], [V, H]
        # On CPU the head stays fp32 even under bf16 autocast: the ratio against the rollout's
        # fp32 log-probs must not carry bf16 logit rounding (~1e-2).
        with torch.autocast("cpu", enabled=False) if rows.device.type == "cpu" else contextlib.nullcontext():
            logp, entropy = packed_logprobs(rows, weight, mb.targets, temperature=temperature, impl=impl)  # [N], [N]
        if mb.rows.numel() == 0:  # padding micro-batch: keep every parameter in the graph
            logp = logp + 0.0 * hidden.sum()
        return logp, entropy


@dataclass(frozen=True)
class ParamShard:
    """This rank's piece of one parameter: rows [row_offset, row_offset + local.shape[0]) of dim 0."""

    name: str
    local: torch.Tensor
    row_offset: int
    global_shape: tuple[int, ...]
