"""Confidence intervals for accuracies: the one implementation that ``staleflow eval``, the main
job's held-out evaluation and ``scripts/bench_convergence.py`` all use.

    lo, hi = wilson(correct=53, n=128)          # a proportion: greedy accuracy, one answer per prompt
    lo, hi = bootstrap_mean(per_prompt_means)   # a mean of per-prompt scores (sampled accuracy, K per prompt)
    lo, hi = t_interval(per_seed_differences)   # a mean of a few independent values (paired seeds)
    pass_at_k(n=8, c=3, k=8)                    # 1.0: at least one of 8 samples was right

Which interval where, and why:
- **Wilson** score interval for a proportion of independent yes/no outcomes (greedy answers to n
  distinct prompts). Unlike the normal approximation p +- z*sqrt(p(1-p)/n), it stays inside [0, 1]
  and keeps close to its nominal 95% coverage at n ~ 100 and at p near 0 or 1.
- **Percentile bootstrap over prompts** when each prompt has K sampled answers: the K answers to
  one prompt are correlated, so the unit of resampling is the prompt, not the answer.
- **Student's t** over seeds for the paired difference of two training modes (same seed = same
  held-out prompts and prompt stream): a handful of seeds is too few for a bootstrap, and t's
  heavier tail (t_0.975 = 4.30 at 3 seeds) is the honest price of few runs.

Pure Python (math, random, statistics); scipy only for the t quantile.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from statistics import NormalDist, fmean, stdev

LEVEL = 0.95


def _z(level: float) -> float:
    if not 0 < level < 1:
        raise ValueError(f"confidence level {level!r} must be in (0, 1)")
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson(correct: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of the proportion correct / n (n independent yes/no outcomes).

    center = (p + z^2 / 2n) / (1 + z^2 / n); half width = z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n).
    """
    if n <= 0 or not 0 <= correct <= n:
        raise ValueError(f"wilson needs 0 <= correct <= n and n >= 1, got correct={correct}, n={n}")
    z = _z(level)
    p, z2 = correct / n, z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # p = 0 or 1: the bound is exactly 0 or 1 (rounding would leave it a hair off)
    return (0.0 if correct == 0 else max(0.0, center - half)), (1.0 if correct == n else min(1.0, center + half))


def bootstrap_mean(
    values: Sequence[float], level: float = LEVEL, n_boot: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (the resampling units), seeded."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("bootstrap_mean needs at least one value")
    rng, n = random.Random(seed), len(vals)
    means = sorted(fmean(rng.choices(vals, k=n)) for _ in range(n_boot))
    tail = (1 - level) / 2
    lo = means[int(math.floor(tail * (n_boot - 1)))]
    hi = means[int(math.ceil((1 - tail) * (n_boot - 1)))]
    return lo, hi


def t_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """Student's t interval of the mean of a few independent values; None with fewer than 2."""
    vals = [float(v) for v in values]
    if len(vals) < 2:
        return None
    from scipy.stats import t

    m, half = fmean(vals), float(t.ppf(0.5 + level / 2, len(vals) - 1)) * stdev(vals) / math.sqrt(len(vals))
    return m - half, m + half


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), the chance that k samples drawn from the n include a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
