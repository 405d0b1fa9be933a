"""The physical floor of a simulated run's step time: what no schedule of the same work can beat.

For a run that trains the responses it trained (every mode: the trained work is what it is), the mean
step time over the measured steps is at least the largest of three terms:

``train``  the trainer's mean busy seconds over the measured steps (it trains one batch at a time, so
           the publication of version k + 1 comes at least step k + 1's training after version k's);
``work``   the step's rollout work over the fleet's throughput at KV capacity. Summed over every decode
           step of every instance, the cost model latency k1*KV + max(k2, k3*n + b3) + k4 totals
           k1*W + max(k2*S, k3*N + b3*S) + k4*S, where N = trained response tokens, W = sum over those
           tokens of their context length (prompt + position: fixed by the lengths, whatever the schedule)
           and S = decode steps, at least max(N / max_running, W / KV capacity) (a step holds at most
           max_running sequences and at most the KV capacity in context tokens). Plus each response's
           prompt prefill. Divided by the fleet's capacity, sum over instances of 1 / speed factor;
``tail``   (longest trained response of a step decoded alone on the fastest instance, + train + the
           weight transfer before a new version can be decoded) / (w + 1), with w the run's observed
           worst staleness: a group tagged V starts after version V is published and pulled and is
           trained at most w steps later, so (w + 1) steps hold train + transfer + its generation.
           With a capped response in (almost) every batch this is the cap decoded alone.

Multi-turn trajectories (sim/turns.py) enter as (prompt, model tokens, observation tokens, tool seconds):
``work`` counts their decoded (model) tokens at the context they would have without the observations
(observations only lengthen it) plus the observations' prefill; tool waits hold KV but no compute, so
they add nothing (the KV they hold is not charged either: still a lower bound). ``tail`` takes, per step,
the trajectory whose turns decoded alone plus its observations' prefill plus its tool calls (each run
once, back to back with its turns) take longest: the tool time is on its critical path.

``util`` = work / floor: the rollout fleet's utilisation if the run stepped at its floor; >= 0.5 is a
throughput-bound row (a schedule has rollout work to place), below that a tail-bound one (a race of
the longest responses: no schedule wins much). Rewards are instantaneous and prefix sharing is not
modelled, so nothing here is cheaper in the simulator than the floor assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

THROUGHPUT_BOUND = 0.5
"""Rollout utilisation at the floor from which a row counts as throughput-bound."""


@dataclass(frozen=True)
class Floor:
    train: float
    work: float
    tail: float

    @property
    def floor(self) -> float:
        return max(self.train, self.work, self.tail)

    @property
    def util(self) -> float:
        return self.work / self.floor if self.floor > 0 else 0.0

    @property
    def binds(self) -> str:
        return max(("train", self.train), ("work", self.work), ("tail", self.tail), key=lambda kv: kv[1])[0]

    @property
    def throughput_bound(self) -> bool:
        return self.util >= THROUGHPUT_BOUND

    def row(self) -> dict:
        return {
            "train_s": round(self.train, 2),
            "work_s": round(self.work, 2),
            "tail_s": round(self.tail, 2),
            "floor_s": round(self.floor, 2),
            "util": round(self.util, 3),
            "binds": self.binds,
        }


def fleet_seconds(cost, lengths: list[tuple], max_running: int, prefill_tokens_per_s: float) -> float:
    """Least instance-seconds (at speed 1) that decoding these (prompt, response length) pairs takes; a
    multi-turn trajectory is (prompt, model tokens, observation tokens, tool seconds)."""
    n_tok = sum(t[1] for t in lengths)
    ctx = sum(t[1] * t[0] + t[1] * (t[1] - 1) / 2.0 for t in lengths)  # sum over tokens of their context length
    steps = max(n_tok / max_running, ctx / cost.kv_capacity)
    decode = cost.k1 * ctx + max(cost.k2 * steps, cost.k3 * n_tok + cost.b3 * steps) + cost.k4 * steps
    return decode + sum(t[0] + (t[2] if len(t) > 2 else 0) for t in lengths) / prefill_tokens_per_s


def alone_s(cost, traj: tuple, prefill_tokens_per_s: float, speed: float) -> float:
    """Seconds one trajectory takes alone on an instance of this speed: its decode and prefill, plus its tool
    calls (multi-turn: (prompt, model tokens, observation tokens, tool seconds))."""
    if len(traj) == 2:
        p, n = traj
        return (cost.steps_time(1, p, n) + p / prefill_tokens_per_s) * speed
    p, n, obs, tool_s = traj
    return (cost.steps_time(1, p, n) + (p + obs) / prefill_tokens_per_s) * speed + tool_s


def physical_floor(
    cost,
    steps: list[list[tuple]],
    train_s: float,
    transfer_s: float,
    worst: int,
    speeds: list[float],
    max_running: int,
    prefill_tokens_per_s: float,
) -> Floor:
    """The floor of a run whose measured steps trained `steps` (per step: (prompt, response length) pairs).

    `transfer_s`: seconds from a training step's end to a new version being decodable (push + pull);
    `speeds`: each instance's factor on the cost model (< 1 faster). A multi-turn trajectory is (prompt, model
    tokens, observation tokens, tool seconds)."""
    if not steps or not speeds:
        return Floor(train_s, 0.0, train_s)
    capacity = sum(1.0 / s for s in speeds)
    per_step = [fleet_seconds(cost, st, max_running, prefill_tokens_per_s) for st in steps]
    work = sum(per_step) / len(steps) / capacity
    fast = min(speeds)
    alone = []
    for st in steps:
        if all(len(t) == 2 for t in st):  # single-turn: the longest response
            alone.append(alone_s(cost, max(st, key=lambda pn: pn[1], default=(0, 0)), prefill_tokens_per_s, fast))
        else:
            alone.append(max(alone_s(cost, t, prefill_tokens_per_s, fast) for t in st))
    tail = (train_s + transfer_s + sum(alone) / len(alone)) / (worst + 1)
    return Floor(train_s, work, tail)
