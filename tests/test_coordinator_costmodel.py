"""Cost-model files (presets, malformed input, fitting) and the multi-level queue order."""

from __future__ import annotations

import json

import pytest

from staleflow.coordinator import CostModel, CostModelError, MultiLevelQueue, fit_cost_model, load_cost_model
from staleflow.coordinator.cost_model import preset_names

PAPER = ["qwen2.5-14b", "qwen2.5-32b-tp2", "qwen2.5-7b-tp1", "qwen2.5-7b-tp2", "qwen3-30b-a3b"]


def test_paper_presets_carry_the_published_coefficients():
    assert set(PAPER) <= set(preset_names())
    cm = load_cost_model("qwen2.5-32b-tp2")
    assert (cm.k1, cm.k2, cm.k3, cm.b3, cm.k4) == (6.3e-8, 0.0250194, 2.446e-4, 0.0183826, 2e-10)
    for name in PAPER:
        cm = load_cost_model(name)
        assert 0 < cm.step_time(1, 0) < 0.05 and cm.kv_capacity > 100_000


def _write(tmp_path, obj, text=None):
    p = tmp_path / "cm.json"
    p.write_text(text if text is not None else json.dumps(obj))
    return str(p)


@pytest.mark.parametrize(
    "obj,text,match",
    [
        (None, "{not json", "not valid JSON"),
        ([1, 2], None, "JSON object"),
        ({"k1": 1e-7, "k2": 0.01, "kv_capacity": 10}, None, "lacks k3"),
        ({"k1": -1e-7, "k2": 0.01, "k3": 1e-4, "kv_capacity": 10}, None, "k1=-1e-07"),
        ({"k1": 1e-7, "k2": "fast", "k3": 1e-4, "kv_capacity": 10}, None, "k2='fast' must be a number"),
        ({"k1": 1e-7, "k2": 0.01, "k3": 1e-4, "kv_capacity": 0}, None, "kv_capacity=0"),
        ({"k1": 1e-7, "k2": 0.01, "k3": 1e-4, "kv_capacity": 10, "k9": 1}, None, "unknown keys"),
        ({"k1": 0, "k2": 0, "k3": 1e-4, "kv_capacity": 10}, None, "must be > 0"),
    ],
)
def test_malformed_coefficient_files_are_rejected_clearly(tmp_path, obj, text, match):
    with pytest.raises(CostModelError, match=match):
        load_cost_model(_write(tmp_path, obj, text))


def test_unknown_preset_and_missing_file():
    with pytest.raises(CostModelError, match="neither a preset"):
        load_cost_model("gpt-5")
    with pytest.raises(CostModelError, match="does not exist"):
        load_cost_model("/nonexistent/cm.json")


def test_fit_recovers_known_coefficients():
    true = CostModel(k1=5e-8, k2=0.02, k3=4e-4, b3=0.004, k4=0.0, kv_capacity=1000)
    samples = [
        (n, float(n * L), true.step_time(n, n * L)) for n in (1, 2, 4, 8, 16, 32, 64, 128) for L in (64, 512, 2048)
    ]
    fit = fit_cost_model(samples, 1000)
    for n, kv, s in samples:
        assert fit.step_time(n, kv) == pytest.approx(s, rel=1e-4)
    with pytest.raises(CostModelError, match="at least 4"):
        fit_cost_model(samples[:2], 1000)


def test_mlq_levels_oldest_first_new_last_longest_first():
    q = MultiLevelQueue()
    places = {}
    for tid, V, tokens in ((1, 3, 10), (2, None, 99), (3, 1, 5), (4, 1, 50), (5, 3, 70)):
        places[tid] = q.push(tid, V, tokens, q.next_arrival())
    assert q.level_keys() == [1, 3, None]
    assert list(q.ids()) == [4, 3, 5, 1, 2]
    assert q.tagged == {1: 2, 3: 2} and q.oldest_version() == 1
    q.remove(places[3])
    assert list(q.ids()) == [4, 5, 1, 2] and len(q) == 4
    q.remove(places[4])
    assert q.tagged == {3: 2} and q.oldest_version() == 3  # level 1 emptied


def test_fifo_queue_keeps_arrival_order_for_loop_backs():
    q = MultiLevelQueue(enabled=False)
    places = {tid: q.push(tid, None, 10, q.next_arrival()) for tid in (1, 2, 3)}
    q.remove(places[1])  # routed ...
    q.push(1, 0, 500, 1)  # ... interrupted: it loops back (its first arrival number) ahead of later arrivals
    assert list(q.ids()) == [1, 2, 3]
    assert q.level_keys() == [None] and q.tagged == {0: 1} and q.oldest_version() == 0  # one level, tags counted
