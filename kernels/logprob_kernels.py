"""Triton kernels for packed log-prob / entropy fused with the LM head (used by ``logprob.py``).

Three kernels, all over *compacted* rows (``rows[i]`` is the packed-token index of the i-th
selected token, so unselected prompt tokens are never loaded or multiplied):

``fwd_partials_kernel``  grid = cdiv(T, BLOCK_M) * NUM_SPLITS, split index fastest so that the
    programs running at the same time share one token tile (hidden, L2-resident) and NUM_SPLITS
    weight streams. Each program walks its fixed slice of the vocabulary in BLOCK_N steps and
    computes the tile ``y = (h @ W^T) * log2(e) / tau`` (the logits in base-2 units, fp32
    accumulation), keeping per row, in fp32 registers:
        m   running max of y                      (starts at NEG, a large negative *finite* number)
        s   sum_j 2^(y_j - m)                     (rescaled by 2^(m_old - m_new))
        w   sum_j 2^(y_j - m) * (y_j - m)  <= 0   (shifted: w_new = a*(w + s*(m_old - m_new)) + ...)
        yt  the target's y (0 if the target is not in this slice)
    and writes them to a [4, NUM_SPLITS, T] fp32 workspace. Per logit that is one FMA (scale +
    padding bias), a max, a subtract, an exp2 and two sums; the target compare runs only on tiles
    that hold a target.
``fwd_merge_kernel``  one program per BLOCK_T packed rows: merges the NUM_SPLITS partials with
    the same shift rules, then (ln2 converts back to nats) ``logp = ln2*((yt - M) - log2 s)``
    (<= 0 by construction: yt <= M and s >= 1), ``entropy = ln2*(log2 s - w/s)`` (>= 0 by
    construction: both terms are >= 0), and saves ``lse2 = M + log2 s``, ``ez2 = M + w/s``
    (lse and E_p[z] in base-2 units) for backward. Unselected rows get 0.
``bwd_dz_kernel``  recomputes a [BLOCK_M, BLOCK_N] tile for a chunk of compacted rows and writes
    ``dz = (g_lp * (onehot - p) - g_H * p * (z - E_p[z])) / tau`` (fp32 math, cast once to the
    workspace dtype); the caller turns dz into dH = dz @ W and dW += dz^T @ h.

The vocabulary split (NUM_SPLITS slices of BLOCKS_PER_SPLIT * BLOCK_N columns) depends only on V
and the block size, never on T, so a token's result does not depend on what else is packed.
Written for triton >= 3.6 (the GPU machine) and the CPU interpreter (TRITON_INTERPRET=1).
"""

import triton
import triton.language as tl

# Globals used inside @triton.jit must be tl.constexpr (the interpreter does not enforce this).
NEG = tl.constexpr(-1.0e30)  # running-max identity: finite, so masked lanes never form (-inf) - (-inf)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    rows,
    m_ok,
    offs_n,
    n_ok,
    H,
    stride_h,
    stride_w,
    scale2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """y[BLOCK_M, BLOCK_N] = (h[rows] @ W[offs_n]^T) * scale2, padded columns = NEG.

    scale2 = log2(e) / temperature: y is the logit in base-2 units, so every exponential is a
    plain exp2 and the padding costs one fused multiply-add (a per-column bias) per element.
    UPCAST (interpreter + bf16 only): triton 3.9's interpreter multiplies bf16 tiles as their raw
    uint16 bits, so there the operands are widened to fp32 first (exact for bf16 values).
    """
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    h_row = h_ptr + rows[:, None].to(tl.int64) * stride_h
    w_col = w_ptr + offs_n[None, :].to(tl.int64) * stride_w
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(h_row + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_col + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    pad = tl.where(n_ok, 0.0, NEG)  # [BLOCK_N]
    return acc * scale2 + pad[None, :]


@triton.jit
def fwd_partials_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    rows_ptr,
    n_active_ptr,
    part_ptr,
    T,
    V,
    H,
    stride_h,
    stride_w,
    scale2,
    BLOCKS_PER_SPLIT,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_s = pid % NUM_SPLITS
    pid_m = pid // NUM_SPLITS
    n_active = tl.load(n_active_ptr)
    if pid_m * BLOCK_M < n_active:  # tiles past the selected rows do nothing
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n_active
        rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0)
        tgt = tl.load(tgt_ptr + rows, mask=m_ok, other=-1)
        m_run = tl.full([BLOCK_M], NEG, dtype=tl.float32)
        s_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        w_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        yt = tl.zeros([BLOCK_M], dtype=tl.float32)
        n_start = pid_s * BLOCKS_PER_SPLIT * BLOCK_N
        n_end = tl.minimum(n_start + BLOCKS_PER_SPLIT * BLOCK_N, V)
        for n0 in range(n_start, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            y = _logits_tile(
                h_ptr,
                w_ptr,
                rows,
                m_ok,
                offs_n,
                offs_n < V,
                H,
                stride_h,
                stride_w,
                scale2,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                DOT_PREC,
                UPCAST,
            )
            m_new = tl.maximum(m_run, tl.max(y, 1))
            alpha = tl.exp2(m_run - m_new)
            d = y - m_new[:, None]  # <= 0; padded columns: ~NEG, exp2 -> 0, e * d -> 0
            e = tl.exp2(d)
            w_run = alpha * (w_run + s_run * (m_run - m_new)) + tl.sum(e * d, 1)
            s_run = alpha * s_run + tl.sum(e, 1)
            m_run = m_new
            # ~10% of tiles hold any of the tile's targets: skip the compare/select elsewhere.
            hit = (tgt >= n0) & (tgt < n0 + BLOCK_N)
            if tl.max(hit.to(tl.int32), 0) > 0:
                yt += tl.sum(tl.where(offs_n[None, :] == tgt[:, None], y, 0.0), 1)
        base = part_ptr + pid_s * T + offs_m
        plane = NUM_SPLITS * T
        tl.store(base, m_run, mask=m_ok)
        tl.store(base + plane, s_run, mask=m_ok)
        tl.store(base + 2 * plane, w_run, mask=m_ok)
        tl.store(base + 3 * plane, yt, mask=m_ok)


@triton.jit
def fwd_merge_kernel(
    part_ptr,
    mask_ptr,
    pos_ptr,
    tgt_ptr,
    logp_ptr,
    ent_ptr,
    lse2_ptr,
    ez2_ptr,
    T,
    V,
    HAS_MASK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = offs < T
    if HAS_MASK:
        active = (tl.load(mask_ptr + offs, mask=in_range, other=0) != 0) & in_range
        pos = tl.load(pos_ptr + offs, mask=active, other=0)
    else:
        active = in_range
        pos = offs
    splits = tl.arange(0, NUM_SPLITS)
    ptrs = part_ptr + splits[None, :] * T + pos[:, None]  # [BLOCK_T, NUM_SPLITS]
    plane = NUM_SPLITS * T
    ld = active[:, None]
    m_i = tl.load(ptrs, mask=ld, other=NEG)
    s_i = tl.load(ptrs + plane, mask=ld, other=0.0)
    w_i = tl.load(ptrs + 2 * plane, mask=ld, other=0.0)
    yt = tl.sum(tl.load(ptrs + 3 * plane, mask=ld, other=0.0), 1)  # one split holds the target
    big_m = tl.max(m_i, 1)
    shift = m_i - big_m[:, None]  # <= 0; empty splits: NEG - M, weight 0
    scale = tl.exp2(shift)
    s = tl.sum(scale * s_i, 1)
    w = tl.sum(scale * (w_i + s_i * shift), 1)
    s_safe = tl.where(active, s, 1.0)
    log2_s = tl.log2(s_safe)  # >= 0: the max element contributes 1
    mean_shift = w / s_safe  # (E_p[y] - M) <= 0
    tgt = tl.load(tgt_ptr + offs, mask=in_range, other=0)
    tgt_ok = (tgt >= 0) & (tgt < V)
    logp = tl.where(tgt_ok, ((yt - big_m) - log2_s) * LN2, float("nan"))  # bad target: NaN
    tl.store(logp_ptr + offs, tl.where(active, logp, 0.0), mask=in_range)
    tl.store(ent_ptr + offs, tl.where(active, (log2_s - mean_shift) * LN2, 0.0), mask=in_range)
    tl.store(lse2_ptr + offs, tl.where(active, big_m + log2_s, 0.0), mask=in_range)
    tl.store(ez2_ptr + offs, tl.where(active, big_m + mean_shift, 0.0), mask=in_range)


@triton.jit
def bwd_dz_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    rows_ptr,
    lse2_ptr,
    ez2_ptr,
    glp_ptr,
    gent_ptr,
    dz_ptr,
    row_start,
    n_rows,
    V,
    H,
    stride_h,
    stride_w,
    stride_dz,
    scale2,
    inv_temp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    group = GROUP_M * num_n  # grouped order: GROUP_M token tiles share each weight tile in L2
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_rows
    rows = tl.load(rows_ptr + row_start + offs_m, mask=m_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < V
    y = _logits_tile(
        h_ptr,
        w_ptr,
        rows,
        m_ok,
        offs_n,
        n_ok,
        H,
        stride_h,
        stride_w,
        scale2,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_PREC,
        UPCAST,
    )
    lse2 = tl.load(lse2_ptr + rows, mask=m_ok, other=0.0)
    ez2 = tl.load(ez2_ptr + rows, mask=m_ok, other=0.0)
    # Chain factors folded per row: dz = d/dz of (g_lp*logp + g_H*H), z = y*ln2 = logits/tau.
    g_lp = tl.load(glp_ptr + rows, mask=m_ok, other=0.0) * inv_temp
    g_h = tl.load(gent_ptr + rows, mask=m_ok, other=0.0) * (inv_temp * LN2)
    tgt = tl.load(tgt_ptr + rows, mask=m_ok, other=-1)
    p = tl.exp2(y - lse2[:, None])  # padded columns: 0
    # g_lp*(onehot - p) - g_H*p*(z - E_p[z]), all in fp32 before the single cast
    dz = tl.where(offs_n[None, :] == tgt[:, None], g_lp[:, None], 0.0) - p * (
        g_lp[:, None] + g_h[:, None] * (y - ez2[:, None])
    )
    dz_ptrs = dz_ptr + offs_m[:, None].to(tl.int64) * stride_dz + offs_n[None, :]
    tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
