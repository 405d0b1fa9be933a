"""Short-lived buffers the memory plan counts on top of the live state, each from the code that makes it.

    adamw_step_bytes(local_numel)                            # torch.optim.AdamW(foreach=True).step()
    logprob_backward_bytes(tokens, hidden, vocab, dtype)     # kernels/logprob.packed_logprobs_backward
    prefill_mask_bytes(args, chunk, context, itemsize)       # rollout/paged_attention.prefill_sdpa
    cuda_graph_pool_bytes(args, rollout_cfg, itemsize)       # rollout/cuda_graphs.DecodeGraphs (--rollout.cuda-graphs)

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
    mm_out_dtype: bool = True,
) -> int:
    """Peak of the Triton log-prob backward over ``tokens`` rows (kernels/logprob.py): dH [T, H] and
    the fp32 dW accumulator [V, H]; the fp32 copies of both incoming gradients [T]; the dz chunk
    [C, V]; each chunk's gathered rows and dH rows [C, H] (this chunk's and, until reassigned, the
    last one's); then the larger of the cast of dW to the weight dtype [V, H] and, where cuBLAS
    cannot accumulate a bf16 GEMM into fp32 in place (``inplace_fp32_accumulate`` False: no
    ``torch.addmm(out_dtype=, out=)``), one chunk's [V, H] product, which ``_accumulate_dw`` makes in
    FP32 (``torch.mm(out_dtype=float32)``; only without that overload, ``mm_out_dtype`` False, is it
    in the input dtype).
    At Qwen2.5-7B (V 152064, H 3584, bf16): fp32 dW 2.0 GiB + dz 1.0 GiB + bf16 dW 1.0 GiB, or
    + the fp32 product 2.0 GiB instead of the bf16 dW where the in-place form is missing."""
    from staleflow.kernels.logprob import _bwd_chunk_tokens, default_config

    weight_dtype = weight_dtype or dtype
    e = dtype.itemsize
    if chunk is None:
        chunk = _bwd_chunk_tokens(vocab, e, default_config(torch.device("cuda"), dtype).bwd_block_m)
    chunk = min(chunk, tokens)
    fixed = tokens * hidden * e + vocab * hidden * 4 + 2 * tokens * 4 + chunk * vocab * e + 4 * chunk * hidden * e
    product = 0 if (inplace_fp32_accumulate or e == 4) else vocab * hidden * (4 if mm_out_dtype else e)
    cast = vocab * hidden * weight_dtype.itemsize if weight_dtype.itemsize < 4 else 0
    return fixed + max(product, cast)


def prefill_mask_bytes(args, chunk_tokens: int, context_tokens: int, itemsize: int) -> int:
    """The built-in engine's masked prefill (a chunk after cached tokens): ModelRunner's [n, L] boolean
    causal mask, and SDPA's additive form of it in the query dtype ([n, L], broadcast to every head:
    ``prefill_sdpa(stack_groups=True)`` no longer repeats it per GQA group). Both live together.
    192 MiB at n = L = 8192 in bf16 (it was 1.3 GiB with the mask repeated for G = 7)."""
    return chunk_tokens * context_tokens * (1 + itemsize)


CUBLAS_WORKSPACE_BYTES = 32 << 20
"""cuBLAS workspace torch allocates per (handle, stream) on sm_90 (CUBLAS_WORKSPACE_CONFIG :4096:8): the
capture stream gets its own, inside the graph pool."""


def addmm_out_dtype_inplace() -> bool:
    """Whether cuBLAS accumulates a bf16 GEMM into an fp32 buffer in place here
    (``torch.addmm(acc, a, b, out_dtype=float32, out=acc)``); False without CUDA (a plan made on a CPU
    machine then counts the fallback's fp32 [V, H] product: the safe side)."""
    if not torch.cuda.is_available():
        return False
    try:
        a = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(16, 16, device="cuda")
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return True
    except Exception:  # no such overload, or no usable CUDA after all: count the fallback
        return False


def cuda_graph_pool_bytes(args, rollout_cfg, itemsize: int) -> int:
    """The memory pool of the built-in engine's captured decode steps (rollout/cuda_graphs.py): every
    bucket's fp32 logits stay live ([b, V] each), the largest bucket's forward intermediates (hidden
    and residual, q|k|v, attention output, gate|up and the SwiGLU product per token, reused across
    layers and buckets), the paged decode kernel's split-K scratch for --rollout.max-model-len (fp32
    m, l [B, parts, Hq] and acc [B, parts, Hq, D], parts = ceil(len / PARTITION)), the static input
    buffers and the capture stream's cuBLAS workspace. ~0.2 GiB at Qwen2.5-7B, 128 sequences."""
    from staleflow.rollout.cuda_graphs import buckets_for

    try:
        from staleflow.kernels.paged_decode import PARTITION
    except ImportError:  # no triton on the planning machine: the kernel module's value
        PARTITION = 512

    buckets = buckets_for(rollout_cfg.max_running)
    b = buckets[-1]
    h, d, hq = args.hidden_size, args.head_dim, args.num_heads
    per_token = 2 * h + (hq + 2 * args.num_kv_heads) * d + hq * d + mlp_per_token(args)
    parts = -(-rollout_cfg.max_model_len // PARTITION)
    scratch = b * parts * hq * (2 + d) * 4
    max_blocks = -(-rollout_cfg.max_model_len // rollout_cfg.block_size)
    static = 3 * b * 8 + (b + b * max_blocks) * 4
    logits = sum(buckets) * args.vocab_size * 4
    return logits + b * per_token * itemsize + scratch + static + CUBLAS_WORKSPACE_BYTES


def mlp_per_token(args) -> int:
    """Elements one token keeps live in the widest MLP of a forward: gate|up and the SwiGLU product
    (3 x intermediate) for a dense layer; for a sparse one its k gathered rows, the k experts' 3 x
    moe-intermediate and weighted outputs, and the router's logits and fp32 probabilities."""
    if not getattr(args, "is_moe", False):
        return 3 * args.intermediate_size
    dense = 3 * args.intermediate_size if not all(args.is_moe_layer(i) for i in range(args.num_layers)) else 0
    k = args.num_experts_per_tok
    return max(dense, k * (2 * args.hidden_size + 3 * args.moe_intermediate_size) + 3 * args.num_experts)
