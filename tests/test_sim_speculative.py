"""Speculative decoding in the simulated engine (sim/speculative.py): a verify forward over n x (k + 1) token rows
costed with the decode model's own terms, used only where it is cheaper per token, and its acceptance a flag."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from staleflow.config import ConfigError
from staleflow.coordinator.cost_model import load_cost_model
from staleflow.sim.engine import SimInstance, SimSequence
from staleflow.sim.speculative import spec_cost

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import sim_config, tiny_sim  # noqa: E402

COST = load_cost_model("qwen2.5-7b-tp1")


def test_sim_speculative_verify_forward_costs_the_decode_terms_of_its_rows():
    s = spec_cost(COST, 2.0, 4)
    for n, kv in ((1, 5_000), (16, 200_000), (128, 800_000)):
        verify = COST.k1 * kv + max(COST.k2, COST.k3 * n * 5 + COST.b3) + COST.k4  # n x (4 + 1) rows, one KV read
        assert s.step_time(n, kv) == pytest.approx(verify / 2.0)  # per token: 2 tokens per forward
    assert spec_cost(COST, 1.0, 4) is None  # accept 1: off
    with pytest.raises(ValueError, match="exceeds"):
        spec_cost(COST, 6.0, 4)


def decode_time(n: int, length: int, accept: float) -> tuple[float, int]:
    """(seconds, tokens decoded speculatively) for n sequences of `length` tokens alone on one instance."""
    inst = SimInstance(
        0, COST, 1e9, 256, rng=random.Random(0), spec=spec_cost(COST, accept, 4), spec_rows=5, spec_accept=accept
    )
    for i in range(n):
        inst.add(SimSequence(i, 0, 20, length))
    done = []
    while len(done) < n:
        out, _ = inst.advance(inst.t + 1.0)
        done += out
    return max(s.t_done for s in done), inst.spec_tokens


def test_sim_speculative_a_lone_sequence_decodes_accept_times_faster():
    plain, _ = decode_time(1, 2000, 1.0)
    fast, spec = decode_time(1, 2000, 2.0)
    assert fast == pytest.approx(plain / 2.0, rel=0.02) and spec == 2000  # at the k2 floor a verify is free


def test_sim_speculative_is_not_used_where_a_verify_costs_more_per_token():
    plain, _ = decode_time(128, 200, 1.0)  # 128 x 5 rows: the GEMMs cost 5 decode steps, 2 tokens come back
    same, spec = decode_time(128, 200, 2.0)
    assert spec == 0 and same == pytest.approx(plain)


def test_sim_speculative_flags_are_checked_and_every_mode_uses_it():
    from staleflow.sim.simulator import run

    with pytest.raises(ConfigError, match="spec-accept"):
        sim_config(spec_accept=0.5)
    with pytest.raises(ConfigError, match="spec-accept"):
        sim_config(spec_accept=6.0, spec_draft_tokens=4)
    off, on = run(tiny_sim(), "staleflow", 1), run(tiny_sim(spec_accept=2.0), "staleflow", 1)
    assert off.spec_frac == 0 < on.spec_frac and on.violations == [] and on.tokens_per_s > off.tokens_per_s
