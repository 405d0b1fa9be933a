"""Short-lived buffers the memory plan counts on top of the live state, each from the code that makes it.

    adamw_step_bytes(local_numel)                            # torch.optim.AdamW(foreach=True).step()
    logprob_backward_bytes(tokens, hidden, vocab, dtype)     # kernels/logprob.packed_logprobs_backward
    prefill_mask_bytes(args, chunk, context, itemsize)       # rollout/paged_attention.prefill_sdpa on CUDA

tests/test_plan_transients.py runs each piece of code on CPU under a dispatch mode that records
every tensor it allocates and checks these formulas against the measured peak at small shapes.
"""

from __future__ import annotations

import torch


def adamw_step_bytes(local_numel: int, state_dtype: torch.dtype = torch.float32) -> int:
    """``torch.optim.AdamW(foreach=True)`` without capturable or weight decay updates exp_avg,
    exp_avg_sq and the parameters in place, but makes one new tensor per parameter:
    ``denom = torch._foreach_sqrt(exp_avg_sq)`` (then divided and eps-added in place), live until
    the parameters are updated. So one state-dtype copy of this rank's parameters (7.1 GiB for a
    7.6B model on 4 ranks in fp32). It runs after backward, when the activations are gone."""
    return local_numel * state_dtype.itemsize


def logprob_backward_bytes(
    tokens: int,
    hidden: int,
    vocab: int,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    chunk: int | None = None,
    inplace_fp32_accumulate: bool = True,
) -> int:
    """Peak of the Triton log-prob backward over ``tokens`` rows (kernels/logprob.py): dH [T, H] and
    the fp32 dW accumulator [V, H]; the fp32 copies of both incoming gradients [T]; the dz chunk
    [C, V]; each chunk's gathered rows and dH rows [C, H] (this chunk's and, until reassigned, the
    last one's); then the larger of the cast of dW to the weight dtype [V, H] and, where cuBLAS
    cannot accumulate a bf16 GEMM into fp32 in place (``inplace_fp32_accumulate`` False: no
    ``torch.addmm(out_dtype=)``), one chunk's [V, H] product. At Qwen2.5-7B (V 152064, H 3584, bf16):
    fp32 dW 2.0 GiB + dz 1.0 GiB + bf16 dW 1.0 GiB."""
    from staleflow.kernels.logprob import _bwd_chunk_tokens, default_config

    weight_dtype = weight_dtype or dtype
    e = dtype.itemsize
    if chunk is None:
        chunk = _bwd_chunk_tokens(vocab, e, default_config(torch.device("cuda"), dtype).bwd_block_m)
    chunk = min(chunk, tokens)
    fixed = tokens * hidden * e + vocab * hidden * 4 + 2 * tokens * 4 + chunk * vocab * e + 4 * chunk * hidden * e
    product = 0 if (inplace_fp32_accumulate or e == 4) else vocab * hidden * e
    cast = vocab * hidden * weight_dtype.itemsize if weight_dtype.itemsize < 4 else 0
    return fixed + max(product, cast)


def prefill_mask_bytes(args, chunk_tokens: int, context_tokens: int, itemsize: int) -> int:
    """The built-in engine's masked prefill on CUDA (``prefill_sdpa(stack_groups=True)``) repeats the
    [n, L] boolean mask for the G query heads of each kv head ([G n, L] bool) and SDPA turns it into
    an additive mask in the query dtype ([G n, L]); both are live together. Without GQA the mask is
    not repeated and only its additive form is made. ~1.3 GiB at n = L = 8192, G = 7, bf16."""
    group = args.num_heads // args.num_kv_heads
    rows = chunk_tokens * context_tokens
    return group * rows * (1 + itemsize) if group > 1 else rows * itemsize
