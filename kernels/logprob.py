"""Packed per-token log-prob and entropy from hidden states and the LM head, without [T, V] logits.

    from staleflow.kernels.logprob import packed_logprobs_triton, triton_available
    logp, entropy = packed_logprobs_triton(hidden, weight, targets, temperature, row_mask)

For every packed token t with ``row_mask[t]`` True: ``z = (W h_t) / temperature``,
``logp_t = z[targets[t]] - logsumexp(z)``, ``entropy_t = logsumexp(z) - sum_j p_j z_j``; both fp32,
differentiable w.r.t. ``hidden`` and ``weight``. Rows with ``row_mask`` False (prompt tokens) are
never loaded or multiplied, get 0 and a zero gradient. A selected row with a target outside
[0, V) gets logp = NaN (checked on the host for CPU tensors; on CUDA the check would cost a
device sync, so the NaN is the signal).

Forward (``logprob_kernels.py``): fixed vocabulary split + merge, O(T) extra memory, results for a
token independent of the rest of the batch. Backward: per chunk of selected tokens, a Triton kernel
recomputes the logits tile and writes dz = d(loss)/d(logits) (fp32 math, stored in the input
dtype), then two matmuls give dH = dz @ W and dW += dz^T @ h with an fp32 dW accumulator.
The backward reads the number of selected rows once (one host sync); the forward never syncs.

Runs on CUDA, or on CPU tensors when TRITON_INTERPRET=1 was set before this module was imported.
"""

import math
import os
from dataclasses import dataclass

import torch

try:
    import triton

    from . import logprob_kernels as _k

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # triton missing or broken: triton_available() says False
    triton = None
    _k = None
    _TRITON_IMPORT_ERROR = exc

# The interpreter is chosen when @triton.jit runs, i.e. at import time: remember that moment.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Tokens per backward chunk; None = sized so the dz workspace stays under BWD_WORKSPACE_BYTES.
BWD_CHUNK_TOKENS: int | None = None
BWD_WORKSPACE_BYTES = 1 << 30
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes. Chosen per (device kind, dtype), never per T, so results are batch invariant."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_splits: int = 16  # power of two; vocabulary slices merged by fwd_merge_kernel
    num_warps: int = 8
    num_stages: int = 3
    bwd_block_m: int = 128
    bwd_block_n: int = 128
    bwd_block_k: int = 64
    bwd_group_m: int = 8
    bwd_num_warps: int = 8
    bwd_num_stages: int = 3


_INTERPRETER_CONFIG = KernelConfig(
    block_m=32, block_n=128, block_k=64, num_splits=16, bwd_block_m=32, bwd_block_n=128, bwd_block_k=64, bwd_group_m=4
)


def triton_available() -> bool:
    """True when the Triton path can run here: CUDA + triton, or triton under TRITON_INTERPRET=1."""
    if _k is None:
        return False
    return _INTERPRETING or torch.cuda.is_available()


def default_config(device: torch.device, dtype: torch.dtype) -> KernelConfig:
    """The fixed tile configuration for a device kind and dtype (independent of T)."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if dtype == torch.float32:  # exact fp32 dot (no tensor cores): small tiles compile spill-free
        return KernelConfig(
            block_m=64,
            block_n=128,
            block_k=32,
            num_stages=2,
            bwd_block_m=64,
            bwd_block_n=64,
            bwd_block_k=32,
            bwd_num_warps=4,
            bwd_num_stages=2,
        )
    return KernelConfig()


def _check_inputs(hidden, weight, targets, temperature, row_mask) -> None:
    if _k is None:
        raise RuntimeError(f"triton is not importable ({_TRITON_IMPORT_ERROR}); use impl='chunked'")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [T, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"hidden/weight dtypes {hidden.dtype}/{weight.dtype}: need one of float32, bfloat16, float16 for both"
        )
    T = hidden.shape[0]
    if targets.shape != (T,) or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"targets must be an int64/int32 tensor of shape ({T},), got {targets.dtype} {tuple(targets.shape)}"
        )
    if row_mask is not None and (row_mask.shape != (T,) or row_mask.dtype != torch.bool):
        raise ValueError(
            f"row_mask must be a bool tensor of shape ({T},), got {row_mask.dtype} {tuple(row_mask.shape)}"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature!r}: need a finite float > 0")
    devices = {hidden.device, weight.device, targets.device} | ({row_mask.device} if row_mask is not None else set())
    if len(devices) != 1:
        raise ValueError(f"hidden, weight, targets, row_mask are on different devices: {devices}")
    device = hidden.device
    if device.type == "cpu" and not _INTERPRETING:
        raise RuntimeError(
            "CPU tensors need TRITON_INTERPRET=1 set before importing staleflow.kernels.logprob (or use impl='chunked')"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device}: the Triton path runs on cuda (or cpu in the interpreter)")
    if device.type == "cpu" and T > 0:  # cheap here; on CUDA it would be a sync (NaN instead)
        sel = targets if row_mask is None else targets[row_mask]
        V = weight.shape[0]
        if sel.numel() and (int(sel.min()) < 0 or int(sel.max()) >= V):
            raise ValueError(
                f"targets of selected rows must lie in [0, {V}), got "
                f"[{int(sel.min())}, {int(sel.max())}]; mask ignored rows with row_mask"
            )


def _select_rows(row_mask: torch.Tensor | None, T: int, device) -> tuple:
    """Compacted row list without a host sync: (rows int32 [T], pos int32 [T], n_active int32 [1])."""
    if row_mask is None:
        rows = torch.arange(T, device=device, dtype=torch.int32)
        return rows, rows, torch.full((1,), T, device=device, dtype=torch.int32)
    pos = torch.cumsum(row_mask, 0, dtype=torch.int32) - 1  # compacted index of each selected row
    dest = torch.where(row_mask, pos.long(), T)  # unselected rows land in a dump slot
    rows = torch.zeros(T + 1, device=device, dtype=torch.int32)
    rows.scatter_(0, dest, torch.arange(T, device=device, dtype=torch.int32))
    n_active = (pos[-1:] + 1) if T > 0 else torch.zeros(1, device=device, dtype=torch.int32)
    return rows[:T], pos, n_active


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32, not TF32


def _upcast_dot(dtype: torch.dtype) -> bool:
    return _INTERPRETING and dtype == torch.bfloat16  # see _logits_tile: interpreter bf16 dot bug


def forward_workspace(T: int, config: KernelConfig, device) -> torch.Tensor:
    """The forward's fp32 partials buffer [4, num_splits, T] (m, s, w, target logit per split)."""
    return torch.empty((4, config.num_splits, T), device=device, dtype=torch.float32)


def packed_logprobs_forward(
    hidden,
    weight,
    targets,
    temperature=1.0,
    row_mask=None,
    config: KernelConfig | None = None,
    out=None,
    workspace=None,
):
    """Forward only, no autograd: returns (logp, entropy, lse2, ez2, rows, n_active).

    lse2 / ez2 are log-sum-exp and E_p[z] in base-2 units (times log2 e), saved for backward.
    ``out``: optional (logp, entropy, lse2, ez2) fp32 [T] buffers to write into; ``workspace``:
    optional ``forward_workspace`` buffer (tests poison both to prove every output element is
    written and no unwritten partial is read).
    """
    _check_inputs(hidden, weight, targets, temperature, row_mask)
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    T, H = hidden.shape
    V = weight.shape[0]
    device = hidden.device
    cfg = config or default_config(device, hidden.dtype)
    if out is None:
        out = tuple(torch.empty(T, device=device, dtype=torch.float32) for _ in range(4))
    logp, ent, lse2, ez2 = out
    rows, pos, n_active = _select_rows(row_mask, T, device)
    if T == 0:
        return logp, ent, lse2, ez2, rows, n_active
    if workspace is None:
        workspace = forward_workspace(T, cfg, device)
    blocks_per_split = triton.cdiv(triton.cdiv(V, cfg.block_n), cfg.num_splits)
    grid = (triton.cdiv(T, cfg.block_m) * cfg.num_splits,)
    _k.fwd_partials_kernel[grid](
        hidden,
        weight,
        targets,
        rows,
        n_active,
        workspace,
        T,
        V,
        H,
        hidden.stride(0),
        weight.stride(0),
        _LOG2E / float(temperature),
        blocks_per_split,
        NUM_SPLITS=cfg.num_splits,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PREC=_dot_precision(hidden.dtype),
        UPCAST=_upcast_dot(hidden.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    block_t = 64
    mask_arg = row_mask if row_mask is not None else rows  # unused when HAS_MASK is False
    _k.fwd_merge_kernel[(triton.cdiv(T, block_t),)](
        workspace,
        mask_arg,
        pos,
        targets,
        logp,
        ent,
        lse2,
        ez2,
        T,
        V,
        HAS_MASK=row_mask is not None,
        NUM_SPLITS=cfg.num_splits,
        BLOCK_T=block_t,
        num_warps=4,
    )
    return logp, ent, lse2, ez2, rows, n_active


def _bwd_chunk_tokens(V: int, elem: int, block_m: int) -> int:
    if BWD_CHUNK_TOKENS is not None:
        return max(1, int(BWD_CHUNK_TOKENS))
    c = BWD_WORKSPACE_BYTES // max(1, V * elem)
    return max(block_m, min(8192, c // block_m * block_m))


def _accumulate_dw(dw_acc: torch.Tensor, dz: torch.Tensor, h_chunk: torch.Tensor) -> None:
    """dw_acc[V, H] (fp32) += dz^T @ h_chunk with fp32 accumulation."""
    if dz.dtype == torch.float32:
        dw_acc.addmm_(dz.t(), h_chunk)
        return
    try:  # torch >= 2.8 on CUDA: cuBLAS accumulates into the fp32 buffer (beta = 1), no temporary
        torch.addmm(dw_acc, dz.t(), h_chunk, out_dtype=torch.float32, out=dw_acc)
        return
    except (TypeError, RuntimeError, NotImplementedError):
        pass
    try:  # same without the in-place form: one [V, H] fp32 temporary per chunk
        dw_acc.add_(torch.mm(dz.t(), h_chunk, out_dtype=torch.float32))
    except (TypeError, RuntimeError, NotImplementedError):
        # Elsewhere: the chunk's product is rounded once to the input dtype (fp32 inside the
        # GEMM), then accumulated in fp32; an fp32 GEMM here would be ~10x slower on GPUs.
        dw_acc.add_(dz.t() @ h_chunk)


def packed_logprobs_backward(
    hidden,
    weight,
    targets,
    temperature,
    rows,
    n_active_host,
    lse2,
    ez2,
    grad_logp,
    grad_ent,
    need_dh=True,
    need_dw=True,
    config: KernelConfig | None = None,
    has_mask=True,
):
    """Gradients (dH [T, H] in hidden's dtype, dW [V, H] in weight's dtype), either may be None."""
    T, H = hidden.shape
    V = weight.shape[0]
    cfg = config or default_config(hidden.device, hidden.dtype)
    dh = torch.zeros_like(hidden) if need_dh else None
    dw_acc = torch.zeros((V, H), device=weight.device, dtype=torch.float32) if need_dw else None
    chunk = _bwd_chunk_tokens(V, hidden.element_size(), cfg.bwd_block_m)
    grad_logp = grad_logp.contiguous().float()
    grad_ent = grad_ent.contiguous().float()
    dz_buf = None
    for c0 in range(0, n_active_host, chunk):
        c = min(chunk, n_active_host - c0)
        if dz_buf is None:
            dz_buf = torch.empty((min(chunk, n_active_host), V), device=hidden.device, dtype=hidden.dtype)
        dz = dz_buf[:c]
        grid = (triton.cdiv(c, cfg.bwd_block_m) * triton.cdiv(V, cfg.bwd_block_n),)
        _k.bwd_dz_kernel[grid](
            hidden,
            weight,
            targets,
            rows,
            lse2,
            ez2,
            grad_logp,
            grad_ent,
            dz,
            c0,
            c,
            V,
            H,
            hidden.stride(0),
            weight.stride(0),
            dz.stride(0),
            _LOG2E / float(temperature),
            1.0 / float(temperature),
            BLOCK_M=cfg.bwd_block_m,
            BLOCK_N=cfg.bwd_block_n,
            BLOCK_K=cfg.bwd_block_k,
            GROUP_M=cfg.bwd_group_m,
            DOT_PREC=_dot_precision(hidden.dtype),
            UPCAST=_upcast_dot(hidden.dtype),
            num_warps=cfg.bwd_num_warps,
            num_stages=cfg.bwd_num_stages,
        )
        if has_mask:
            idx = rows[c0 : c0 + c].long()
            h_chunk = hidden.index_select(0, idx) if need_dw else None
        else:
            idx = None
            h_chunk = hidden[c0 : c0 + c]
        if need_dh:
            dh_chunk = dz @ weight  # [c, H]
            if idx is None:
                dh[c0 : c0 + c] = dh_chunk
            else:
                dh.index_copy_(0, idx, dh_chunk)
        if need_dw:
            _accumulate_dw(dw_acc, dz, h_chunk)
    dw = None
    if need_dw:
        dw = dw_acc if weight.dtype == torch.float32 else dw_acc.to(weight.dtype)
    return dh, dw


class _PackedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, row_mask):
        hidden_c, weight_c, targets_c = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        logp, ent, lse2, ez2, rows, n_active = packed_logprobs_forward(
            hidden_c, weight_c, targets_c, temperature, row_mask
        )
        ctx.save_for_backward(hidden_c, weight_c, targets_c, rows, n_active, lse2, ez2)
        ctx.temperature = float(temperature)
        ctx.has_mask = row_mask is not None
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, rows, n_active, lse2, ez2 = ctx.saved_tensors
        n_host = int(n_active.item()) if ctx.has_mask else hidden.shape[0]  # the one sync
        dh, dw = packed_logprobs_backward(
            hidden,
            weight,
            targets,
            ctx.temperature,
            rows,
            n_host,
            lse2,
            ez2,
            grad_logp,
            grad_ent,
            need_dh=ctx.needs_input_grad[0],
            need_dw=ctx.needs_input_grad[1],
            has_mask=ctx.has_mask,
        )
        return dh, dw, None, None, None


def packed_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
):
    """(logp [T] fp32, entropy [T] fp32) for packed tokens; see the module docstring."""
    return _PackedLogprobs.apply(hidden, weight, targets, temperature, row_mask)
