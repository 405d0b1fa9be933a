"""Response-length distributions of the simulated workload (each trajectory's length is drawn).

``lognormal``  median and sigma of a lognormal, capped at max_response (an assumption).
``long-cot``   a mixture parametrised from published long-CoT RL statistics (no percentile table
               of RL rollout lengths was found; docs/baselines-research.md section 4):
               - each prompt has a difficulty p ~ Beta(0.8, 1.2) (40 % of responses wrong on average)
                 and a length scale exp(N(0, 0.35)): responses to one prompt have similar lengths
                 (Seer, arXiv 2511.14617, builds its scheduler on this);
               - a response is wrong with probability p; wrong responses are 3x longer than right
                 ones (DeepScaleR: incorrect responses ~3x the length of correct ones);
               - length = 2500 x scale x (3 if wrong else 1) x exp(N(0, 0.6)), capped at max_response.
               At a 20k cap: mean ~5.5k (DeepScaleR's 5.5k at the start of its 8k stage), median
               ~3.8k, p90 ~12.4k, ~3 % truncated (AReaL v0.2 reports < 5 % at 27k), the longest 10 %
               of responses hold ~31 % of the tokens (and, run alone at the end, a larger share of the
               rollout time: Seer's "last 10 % of requests take up to 50 % of rollout time").
``file``       lengths_file: empirical lengths sampled with replacement.
"""

from __future__ import annotations

import math
import random

LENGTH_DISTS = ("lognormal", "long-cot")


class LengthSampler:
    """Draws per-prompt parameters at ``new_prompt`` and per-response lengths at ``__call__``."""

    def __init__(
        self, dist: str, median: float, sigma: float, cap: int, rng: random.Random, samples: list[int] | None = None
    ):
        if dist not in LENGTH_DISTS:
            raise ValueError(f"--length-dist={dist!r} is unknown; choose one of {', '.join(LENGTH_DISTS)}")
        self.dist, self.rng, self.cap = dist, rng, cap
        self.mu, self.sigma = math.log(median), sigma
        self.samples = samples or []
        self.p_wrong, self.scale = 0.0, 1.0

    def new_prompt(self) -> None:
        if self.dist == "long-cot" and not self.samples:
            self.p_wrong = self.rng.betavariate(0.8, 1.2)
            self.scale = math.exp(self.rng.gauss(0.0, 0.35))

    def __call__(self) -> int:
        r = self.rng
        if self.samples:
            x = r.choice(self.samples)
        elif self.dist == "long-cot":
            wrong = r.random() < self.p_wrong
            x = 2500.0 * self.scale * (3.0 if wrong else 1.0) * math.exp(r.gauss(0.0, 0.6))
        else:
            x = r.lognormvariate(self.mu, self.sigma)
        return max(1, min(self.cap, int(round(x))))
