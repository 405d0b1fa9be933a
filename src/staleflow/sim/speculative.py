"""Speculative decoding in the simulated engine: what a verify forward costs and when an engine uses it.

A draft of ``k`` tokens per sequence (a suffix or n-gram match over the group's sibling responses and the
trajectory's own tokens: no draft model to run) is verified in ONE forward over k + 1 positions per
sequence; with exact rejection sampling the sampled distribution is unchanged, and the forward yields
``accept`` tokens per sequence on average (the accepted draft tokens plus the one the verify step always
samples; 1 <= accept <= k + 1). The verify forward is costed with the decode cost model's own terms
(coordinator/cost_model.py, latency = k1 KV + max(k2, k3 rows + b3) + k4):

- k1 x KV: the attention reads the KV cache once per forward, whatever the number of query positions
  (decode attention is memory-bound; with GQA the k + 1 queries of a sequence share its KV read);
- max(k2, k3 x rows + b3) with rows = n x (k + 1): every verified position is a token row of the GEMMs and
  MoE layers, priced at the slope k3 that prices one decode token (the fit's compute-bound part); below the
  knee, where a forward reads the weights once (k2), the extra rows are free;
- k4 once.

So a verify forward over n sequences takes the decode latency of n (k + 1) rows, and each sequence gains
``accept`` tokens: per token (the simulated engine's step is one token position of every running sequence)
the cost is that latency / accept, i.e. a cost model with k1, k2, b3, k4 divided by accept and k3 multiplied
by (k + 1) / accept (``spec_cost``). An engine speculates in a stretch only when that is cheaper per token
than plain decoding at its batch size and KV (``SimInstance.advance``; vLLM's suffix decoding and Seer's
adaptive drafting likewise speculate where it pays): at small batch (the k2 floor) a verify costs about one
decode step and the speed-up is ~accept; at large batch the k + 1 rows cost k + 1 decode steps' GEMMs and
speculation does not pay. The acceptance is an input (``--spec-accept``; docs/simulator.md has its sources and
a sweep), not modelled per token: the simulated responses have lengths, not text.
"""

from __future__ import annotations

import dataclasses

from staleflow.coordinator.cost_model import CostModel


def spec_cost(cost: CostModel, accept: float, draft: int) -> CostModel | None:
    """The per-token cost model of speculative decoding (module docstring); None when it is off (accept <= 1)."""
    if accept <= 1.0 or draft < 1:
        return None
    if accept > draft + 1:
        raise ValueError(f"--spec-accept={accept} exceeds --spec-draft-tokens + 1 = {draft + 1}")
    return dataclasses.replace(
        cost,
        k1=cost.k1 / accept,
        k2=cost.k2 / accept,
        k3=cost.k3 * (draft + 1) / accept,
        b3=cost.b3 / accept,
        k4=cost.k4 / accept,
        name=f"{cost.name}-spec",
    )
