"""Multi-turn, tool-using trajectories in the simulator: a trajectory's decode split into turns with tool waits.

A ``TurnPlan`` is drawn per trajectory by the workload (sim/simulator.SimWorkload, with the response
length): K tool calls (uniform in [tool_calls_min, tool_calls_max]), the drawn model tokens L split into
K + 1 turns at uniform random cut points (each turn >= 1 token), each call's tool latency from a lognormal
with median ``tool_latency_median_s`` and 99th percentile ``tool_latency_p99_s`` (sigma = ln(p99 /
median) / 2.326), and ``tool_obs_tokens`` observation tokens appended after each call. Positions count
every response token, model and observation alike (the runtime's response_ids, whose observation tokens
are loss-masked): turn i ends (its tool call is issued) at ``ends[i]``; the call's observation then
occupies positions ends[i] .. ends[i] + obs; the trajectory ends at ``total`` = L + K x obs.

The instance (sim/engine.py) parks a sequence at each end: it stops decoding, its KV stays resident (the
built-in engine's Request.hold), and after the call's latency the observation is prefilled (only the
observation: the engine's extend) and the next turn decodes. A pull leaves a parked sequence parked (the
coordinator's rule, coordinator/pull.py: the snapshot names it) and migration never moves it; without keep-KV
the pull frees its KV and, when the call returns, its prefix plus the observation is prefilled under the new
version. A trajectory taken off while it waits anyway (an abort, a straggler's truncation, an Interrupt sent
before the snapshot saw its turn end) has its position at a tool call whose answer is not in its record:
wherever it resumes it re-prefills its prefix and re-runs that call (the same latency: the same call on the
same input), then continues. The same seed gives every mode the same plans.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

AGENTIC = (
    ("tool_calls_min", 4),
    ("tool_calls_max", 8),
    ("tool_latency_median_s", 2.0),
    ("tool_latency_p99_s", 30.0),
    ("tool_obs_tokens", 300),
)
"""The grid's agentic setting (sim/grid.py "7B agentic 64:64": 7B lognormal 64:64's model tokens per trajectory):
4-8 tool calls, each a heavy-tailed wait (median 2 s, p99 30 s) and 300 observation tokens (SimConfig
fields; docs/simulator.md "Tool latency" has the sources and what is assumed)."""

Z99 = 2.3263478740408408
"""The standard normal's 99th percentile: a lognormal's p99 is median x exp(Z99 x sigma)."""


@dataclass(frozen=True)
class TurnPlan:
    ends: tuple[int, ...]
    """Response position at which each tool call is issued (ascending; observation tokens included)."""
    tool_s: tuple[float, ...]
    """Seconds each call takes (one per end)."""
    obs: int
    """Observation tokens appended after each call."""
    total: int
    """Response tokens of the whole trajectory: model tokens + len(ends) x obs."""

    @property
    def calls(self) -> int:
        return len(self.ends)

    @property
    def obs_tokens(self) -> int:
        return self.obs * len(self.ends)

    @property
    def model_tokens(self) -> int:
        return self.total - self.obs_tokens

    @property
    def tool_total(self) -> float:
        return sum(self.tool_s)

    def call_at(self, position: int) -> int:
        """Index of the call issued at this position, -1 if none is (the sequence is mid-turn)."""
        try:
            return self.ends.index(position)
        except ValueError:
            return -1

    def next_stop(self, position: int) -> int:
        """Where decoding from `position` stops: the next call's position, else the trajectory's end."""
        return next((e for e in self.ends if e > position), self.total)


def lognormal_sigma(median: float, p99: float) -> float:
    return math.log(p99 / median) / Z99


class TurnSampler:
    """Draws TurnPlans (its own random stream: the lengths' stream is the single-turn workload's)."""

    def __init__(
        self, calls_min: int, calls_max: int, median_s: float, p99_s: float, obs_tokens: int, rng: random.Random
    ):
        self.lo, self.hi, self.obs, self.rng = calls_min, calls_max, obs_tokens, rng
        self.mu, self.sigma = math.log(median_s), lognormal_sigma(median_s, p99_s)

    def __call__(self, model_tokens: int) -> TurnPlan:
        r = self.rng
        k = min(r.randint(self.lo, self.hi), model_tokens - 1)  # every turn decodes at least one token
        cuts = sorted(r.sample(range(1, model_tokens), k)) if k > 0 else []
        ends = tuple(c + i * self.obs for i, c in enumerate(cuts))
        tool_s = tuple(r.lognormvariate(self.mu, self.sigma) for _ in cuts)
        return TurnPlan(ends, tool_s, self.obs, model_tokens + k * self.obs)
