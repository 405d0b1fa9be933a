"""Throughput cost model of one rollout instance (paper section 6.2).

Per decode step every running trajectory produces one token, and the step latency is

    latency(n, KV) = k1 * KV + max(k2, k3 * n + b3) + k4        [seconds]
    T(n, KV)       = n / latency(n, KV)                           [tokens / s]

with n running trajectories and KV resident KV-cache tokens: an attention term linear in KV, a
non-attention (GEMM/MoE) term that is flat (memory-bound floor k2) at small batch and then
linear in n, and a constant. The paper writes max(k2, k3*n); the authors' fitted coefficients
(PSRL ``cost_model/*.json``) also carry the intercept b3 (``other_b``) inside the max, so b3 is
kept (0 gives the paper's form). k5 of the paper (length -> KV units) is 1 here: KV is counted
in tokens.

Coefficients live in JSON files (``presets/<name>.json``); ``load_cost_model(name_or_path)``
reads a preset or any file. Used by the waterfall router (marginal gain) and by the simulator
(step time of a simulated instance).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

PRESET_DIR = Path(__file__).with_name("presets")
_FIELDS = ("k1", "k2", "k3", "b3", "k4", "kv_capacity")
_METADATA = ("name", "source", "fit", "model", "dtype", "hardware", "torch", "date", "load_average_1min")
"""Keys a cost-model JSON may carry besides the coefficients (what scripts/fit_cost_model.py writes)."""


class CostModelError(ValueError):
    """A malformed or missing coefficients file; the message names the file, the field and the fix."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """Decode-step latency/throughput of one instance; all coefficients in seconds (per token / per request)."""

    k1: float
    """Seconds per resident KV token per step (attention)."""
    k2: float
    """Floor of the non-attention term, seconds per step."""
    k3: float
    """Seconds per running trajectory per step (non-attention, compute-bound part)."""
    b3: float = 0.0
    """Intercept of the linear non-attention part (inside the max; 0 = the paper's form)."""
    k4: float = 0.0
    """Constant seconds per step."""
    kv_capacity: int = 1 << 20
    """KV-cache capacity of one instance, in tokens."""
    name: str = "custom"
    source: str = ""

    def __post_init__(self):
        for f in ("k1", "k2", "k3", "b3", "k4"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise CostModelError(f"cost model {self.name!r}: {f}={v!r} must be a finite number >= 0")
        if self.k2 + self.b3 + self.k4 <= 0:
            raise CostModelError(f"cost model {self.name!r}: k2 + b3 + k4 must be > 0 (an empty step cannot take 0 s)")
        if not (isinstance(self.kv_capacity, int) and self.kv_capacity >= 1):
            raise CostModelError(f"cost model {self.name!r}: kv_capacity={self.kv_capacity!r} must be an int >= 1")

    def step_time(self, n: int, kv: float) -> float:
        """Latency of one decode step with n running trajectories holding kv KV tokens."""
        return self.k1 * kv + max(self.k2, self.k3 * n + self.b3) + self.k4

    def throughput(self, n: int, kv: float) -> float:
        """Tokens per second of the instance (0 when idle)."""
        return n / self.step_time(n, kv) if n > 0 else 0.0

    def gain(self, n: int, kv: float, tokens: int) -> float:
        """Marginal throughput of adding one trajectory that brings `tokens` KV tokens: T(S') - T(S)."""
        return self.throughput(n + 1, kv + tokens) - self.throughput(n, kv)

    def ideal_gain(self, tokens: int) -> float:
        """Gain of the same trajectory on an empty instance (the waterfall's reference, dT_ideal)."""
        return 1.0 / self.step_time(1, tokens)

    def steps_time(self, n: int, kv: float, k: int) -> float:
        """Total time of k consecutive decode steps with n running, KV growing by n per step."""
        if k <= 0:
            return 0.0
        return k * self.step_time(n, kv) + self.k1 * n * k * (k - 1) / 2.0

    def steps_within(self, n: int, kv: float, dt: float) -> int:
        """Largest k with steps_time(n, kv, k) <= dt (how many whole steps fit in dt seconds)."""
        if n <= 0:
            return 0
        s0 = self.k1 * kv + max(self.k2, self.k3 * n + self.b3) + self.k4
        if dt < s0:
            return 0
        a = self.k1 * n / 2.0  # steps_time(k) = k * s0 + a * k * (k - 1)
        if a <= 0:
            return int(dt / s0)
        b = s0 - a
        k = int((-b + math.sqrt(b * b + 4.0 * a * dt)) / (2.0 * a))
        if k * s0 + a * k * (k - 1) > dt:  # floating-point guard: the root is within one step
            k -= 1
        elif (k + 1) * s0 + a * (k + 1) * k <= dt:
            k += 1
        return k

    def to_dict(self) -> dict:
        return {"name": self.name, **{f: getattr(self, f) for f in _FIELDS}, "source": self.source}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_cost_model(name_or_path: str) -> CostModel:
    """A preset by name (see preset_names()) or a JSON file with k1, k2, k3, [b3], [k4], kv_capacity."""
    path = Path(name_or_path)
    if not path.suffix == ".json":
        path = PRESET_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise CostModelError(
                f"cost model {name_or_path!r} is neither a preset ({', '.join(preset_names())}) nor a .json file"
            )
    if not path.exists():
        raise CostModelError(
            f"cost model file {str(path)!r} does not exist; give a preset name or an existing .json file"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CostModelError(f"cost model file {str(path)!r} is not valid JSON ({e}); fix the file") from None
    if not isinstance(raw, dict):
        raise CostModelError(f"cost model file {str(path)!r} must hold a JSON object with keys {', '.join(_FIELDS)}")
    missing = [f for f in ("k1", "k2", "k3", "kv_capacity") if f not in raw]
    if missing:
        raise CostModelError(
            f"cost model file {str(path)!r} lacks {', '.join(missing)}; "
            f"needed: k1, k2, k3, kv_capacity (optional b3, k4)"
        )
    unknown = sorted(set(raw) - set(_FIELDS) - set(_METADATA))
    if unknown:
        raise CostModelError(
            f"cost model file {str(path)!r} has unknown keys {unknown}; allowed: "
            f"{', '.join(_FIELDS)} and the metadata {', '.join(_METADATA)}"
        )
    vals = {f: raw[f] for f in _FIELDS if f in raw}
    for f, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CostModelError(f"cost model file {str(path)!r}: {f}={v!r} must be a number")
    return CostModel(**vals, name=str(raw.get("name", path.stem)), source=str(raw.get("source", str(path))))


def fit_cost_model(
    samples: list[tuple[int, float, float]],
    kv_capacity: int,
    name: str = "fitted",
    source: str = "",
    robust: bool = True,
) -> CostModel:
    """The one cost-model fitter: latency = k1*KV + max(k2, k3*n + b3) to (n, KV, seconds) samples.

    Residuals are RELATIVE (small and large batches count alike) and, with ``robust``, a
    soft-L1 loss (iteratively reweighted) discounts steps slowed by other jobs on a shared host.
    The kink of the max is found by scanning the breakpoint n* over a log grid of batch sizes and
    refining it by golden-section search: below n* the non-attention term is the constant k2,
    above it k3*n + b3 (continuity at n* ties b3 = k2 - k3*n*, clipped at 0). Each candidate n*
    is a weighted linear least-squares problem (coefficients clipped at 0). A constant per-step
    cost is absorbed by k2 and b3 (k4 = 0).
    """
    import numpy as np

    if len(samples) < 4:
        raise CostModelError(f"fit needs at least 4 (n, kv, seconds) samples, got {len(samples)}")
    a = np.asarray(samples, dtype=np.float64)
    n, kv, y = a[:, 0], a[:, 1], a[:, 2]
    if (y <= 0).any() or (n <= 0).any():
        raise CostModelError("fit needs samples with n >= 1 running sequences and a positive latency")

    def solve(ns: float, w):
        # latency = k1*kv + c + k3*max(0, n - ns): c = k2, and b3 = c - k3*ns; rows weighted by w / y
        X = np.stack([kv, np.ones_like(n), np.maximum(0.0, n - ns)], axis=1)
        ww = (w / y)[:, None]
        coef, *_ = np.linalg.lstsq(X * ww, y * ww[:, 0], rcond=None)
        coef = np.maximum(coef, 0.0)
        rel = (X @ coef - y) / y
        return float(np.sum(w * rel**2)), ns, coef, rel

    def best_kink(w):
        grid = np.geomspace(max(0.5, n.min() / 2), n.max() * 2, 200)
        best = min((solve(float(g), w) for g in grid), key=lambda r: r[0])
        i = int(np.searchsorted(grid, best[1]))
        lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
        for _ in range(40):  # golden-section refinement between neighbouring grid points
            m1, m2 = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
            if solve(m1, w)[0] <= solve(m2, w)[0]:
                hi = m2
            else:
                lo = m1
        return min(best, solve((lo + hi) / 2, w), key=lambda r: r[0])

    w = np.ones_like(y)
    best = best_kink(w)
    if robust:  # soft-L1 (f_scale 0.1): weight 1 / sqrt(1 + (r / 0.1)^2) on each relative residual
        for _ in range(4):
            w = 1.0 / np.sqrt(1.0 + (best[3] / 0.1) ** 2)
            best = best_kink(w)
    _, ns, (k1, c, k3), _ = best
    return CostModel(
        k1=float(k1),
        k2=float(c),
        k3=float(k3),
        b3=float(max(0.0, c - k3 * ns)),
        k4=0.0,
        kv_capacity=int(kv_capacity),
        name=name,
        source=source,
    )


def fit_error(model: CostModel, samples: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(mean, max) relative error of the model's step time on (n, KV, seconds) samples."""
    rel = [abs(model.step_time(int(n), kv) - y) / y for n, kv, y in samples]
    return sum(rel) / max(len(rel), 1), max(rel, default=0.0)
