"""Fit the decode cost model of the StaleFlow paper to an engine's profiled steps.

    engine = BuiltinEngine(model, profile=True)        # records a CostSample per step
    ... run decode work ...
    coeffs = fit_cost_model(engine.profile_samples)    # {"k1", "k2", "k3", "k4", ...}

Model (paper section 6.2): the latency of one decode step with n running sequences and KV
resident KV tokens is
    latency(n, KV) = k1 * KV + max(k2, k3 * n) + k4        [seconds]
and the instance throughput is T = n / latency. k1: attention cost per KV token; k2: the
memory-bound floor of the GEMMs (weights streamed once per step); k3: per-sequence GEMM cost
once compute-bound; k4: a constant. Only pure-decode steps (no prefill tokens) are used.
The fit is scipy curve_fit with non-negative bounds, on RELATIVE residuals (sigma = latency),
so small and large batches count alike, with a robust soft-L1 loss (steps slowed down by other
jobs on a shared machine are outliers, not signal), from several starting points (the max()
makes the loss non-smooth, and k2/k4 trade off when the floor always binds).
"""

from __future__ import annotations

from typing import Iterable

from staleflow.rollout.engine import CostSample


def latency_model(n, kv, k1: float, k2: float, k3: float, k4: float):
    """Works on floats and on numpy arrays."""
    import numpy as np

    return k1 * kv + np.maximum(k2, k3 * n) + k4


def fit_cost_model(samples: Iterable[CostSample], min_samples: int = 4) -> dict:
    """Least-squares coefficients k1..k4 (>= 0) plus fit quality, from pure-decode samples."""
    import numpy as np
    from scipy.optimize import curve_fit

    dec = [s for s in samples if s.prefill_tokens == 0 and s.n_running > 0 and s.latency_s > 0]
    if len(dec) < min_samples:
        raise ValueError(f"only {len(dec)} pure-decode samples (need >= {min_samples}): profile more decode "
                         f"steps (profile=True, several batch sizes and context lengths)")
    n = np.array([s.n_running for s in dec], dtype=np.float64)
    kv = np.array([s.kv_tokens for s in dec], dtype=np.float64)
    y = np.array([s.latency_s for s in dec], dtype=np.float64)

    def f(x, k1, k2, k3, k4):
        return latency_model(x[0], x[1], k1, k2, k3, k4)

    # starting points: floor at the smallest / median latency, slope from the largest batches
    per_seq = float(np.median(y / n))
    starts = [[0.0, float(y.min()), per_seq, 0.0], [1e-7, float(np.median(y)), per_seq / 2, 0.0],
              [1e-6, float(y.min()) / 2, per_seq, float(y.min()) / 2], [1e-8, 0.0, per_seq, float(y.min())]]
    best = None
    for p0 in starts:
        try:
            popt, _ = curve_fit(f, np.vstack([n, kv]), y, p0=p0, sigma=y, bounds=(0.0, np.inf), maxfev=20000,
                                loss="soft_l1", f_scale=0.1)
        except RuntimeError:  # no convergence from this start
            continue
        rel = (f(np.vstack([n, kv]), *popt) - y) / y
        sse = float((rel ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, popt, rel)
    if best is None:
        raise ValueError("cost-model fit did not converge from any starting point: check the samples")
    _, popt, rel = best
    k1, k2, k3, k4 = (float(x) for x in popt)
    return {"k1": k1, "k2": k2, "k3": k3, "k4": k4, "n_samples": len(dec),
            "mean_rel_err": float(np.abs(rel).mean()), "max_rel_err": float(np.abs(rel).max())}
