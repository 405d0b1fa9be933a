"""Confidence intervals for accuracies: the one implementation that ``staleflow eval``, the main
job's held-out evaluation and ``scripts/bench_convergence.py`` all use.

    lo, hi = wilson(correct=53, n=128)          # a proportion: greedy accuracy, one answer per prompt
    lo, hi = bootstrap_mean(per_prompt_means)   # a mean of per-prompt scores (sampled accuracy, K per prompt)
    lo, hi = t_interval(per_seed_differences)   # a mean of a few independent values (paired seeds)
    spearman(drawn_order, trained_order)        # rank correlation, ties at their average rank
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


def tost(values: Sequence[float], margin: float, alpha: float = 0.05) -> dict | None:
    """Two one-sided t tests that the mean of paired differences lies within (-margin, +margin).

    H0a: mean <= -margin and H0b: mean >= +margin, each rejected at `alpha`; the means are
    equivalent within the margin when both are (p = the larger one-sided p < alpha), which is the
    same as the (1 - 2 alpha) t interval lying inside the margin. None with fewer than 2 values.
    """
    vals = [float(v) for v in values]
    if len(vals) < 2:
        return None
    if margin <= 0:
        raise ValueError(f"tost margin {margin!r} must be > 0")
    from scipy.stats import t

    n, m, df = len(vals), fmean(vals), len(vals) - 1
    se = stdev(vals) / math.sqrt(n)
    if se == 0:
        p_low = p_high = 0.0 if abs(m) < margin else 1.0
    else:
        p_low = float(t.sf((m + margin) / se, df))  # H0a: mean <= -margin
        p_high = float(t.cdf((m - margin) / se, df))  # H0b: mean >= +margin
    half = float(t.ppf(1 - alpha, df)) * se
    p = max(p_low, p_high)
    return {
        "mean": m,
        "margin": margin,
        "p": p,
        "ci": (m - half, m + half),
        "level": 1 - 2 * alpha,
        "equivalent": p < alpha,
    }


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the probability, if each decided pair were a fair coin, of a split at
    least as uneven as wins : losses (ties are left out before calling). 1.0 with no decided pair."""
    if wins < 0 or losses < 0:
        raise ValueError(f"sign_test needs counts >= 0 (got {wins}, {losses})")
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def paired_seeds_needed(sd: float, delta: float, power: float = 0.8, alpha: float = 0.05, most: int = 1000) -> int:
    """The fewest paired seeds for a two-sided paired t test at `alpha` to detect a true mean
    difference `delta` with probability `power`, when the per-seed differences have standard
    deviation `sd` (exact: the noncentral t distribution, nc = delta / (sd / sqrt(n)))."""
    if sd <= 0 or delta <= 0 or not 0 < power < 1:
        raise ValueError(f"paired_seeds_needed needs sd > 0, delta > 0, 0 < power < 1 (got {sd}, {delta}, {power})")
    from scipy.stats import nct, t

    for n in range(2, most + 1):
        df, nc = n - 1, delta / (sd / math.sqrt(n))
        crit = float(t.ppf(1 - alpha / 2, df))
        if float(nct.sf(crit, df, nc) + nct.cdf(-crit, df, nc)) >= power:
            return n
    return most


def tost_seeds_needed(
    sd: float, margin: float, power: float = 0.8, alpha: float = 0.05, true_diff: float = 0.0, most: int = 200
) -> int:
    """The fewest paired seeds for tost() at `margin` to declare equivalence with probability
    `power` when the true mean difference is `true_diff` and the per-seed differences have standard
    deviation `sd` (normal differences; Monte Carlo, 20000 draws per n, seeded)."""
    if sd <= 0 or margin <= abs(true_diff) or not 0 < power < 1:
        raise ValueError(f"tost_seeds_needed needs sd > 0, |true_diff| < margin, 0 < power < 1 (got {sd}, {margin})")
    import numpy as np
    from scipy.stats import t

    rng = np.random.default_rng(0)
    for n in range(2, most + 1):
        d = rng.normal(true_diff, sd, (20000, n))
        m, half = d.mean(axis=1), float(t.ppf(1 - alpha, n - 1)) * d.std(axis=1, ddof=1) / math.sqrt(n)
        if float(np.mean((m - half > -margin) & (m + half < margin))) >= power:
            return n
    return most


def chi2_two_sample(a: Sequence, b: Sequence, min_expected: float = 5.0) -> dict:
    """Pearson's chi-square test that two samples of hashable outcomes (token tuples) come from one
    distribution: the 2 x K table of counts, outcomes whose expected count under the pooled
    distribution is below `min_expected` in either row merged into one "rare" column (so the chi-square
    approximation holds). Returns {"statistic", "df", "p", "cells"}; p 1.0 when fewer than 2 cells
    remain. Used by the speculative decoding check (scripts/bench_speculative.py, its tests)."""
    from collections import Counter

    from scipy.stats import chi2

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    if not na or not nb:
        raise ValueError(f"chi2_two_sample needs two non-empty samples (got {na} and {nb})")
    small = min(na, nb) / (na + nb)
    cols, rare = [], [0, 0]
    for key in ca.keys() | cb.keys():
        x, y = ca[key], cb[key]
        if (x + y) * small < min_expected:
            rare[0] += x
            rare[1] += y
        else:
            cols.append((x, y))
    if rare[0] + rare[1]:
        if (rare[0] + rare[1]) * small >= min_expected or not cols:
            cols.append(tuple(rare))
        else:  # too rare even merged: into the smallest column
            j = min(range(len(cols)), key=lambda i: sum(cols[i]))
            cols[j] = (cols[j][0] + rare[0], cols[j][1] + rare[1])
    if len(cols) < 2:
        return {"statistic": 0.0, "df": 0, "p": 1.0, "cells": len(cols)}
    stat = 0.0
    for x, y in cols:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(cols) - 1
    return {"statistic": stat, "df": df, "p": float(chi2.sf(stat, df)), "cells": len(cols)}


def _ranks(x: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties given their average rank (Spearman's convention)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's over average ranks); nan under two points, a constant side or a nan
    value; ValueError when the two sides differ in length."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} values against {len(y)}: pass one value per item on each side")
    if len(x) < 2 or any(math.isnan(v) for v in (*x, *y)):
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    mx, my = fmean(rx), fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return float("nan")
    return sxy / math.sqrt(sxx * syy)
