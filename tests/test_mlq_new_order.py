"""--coordinator.new-order: new prompts routed longest first (the paper code's queue) or in drawing order (issue 41)."""

from __future__ import annotations

import pytest
from test_coordinator import make, routes, set_version, traj

from staleflow.coordinator.mlq import MultiLevelQueue


def test_drawn_order_keeps_new_prompts_in_arrival_order_and_loop_backs_longest_first():
    q = MultiLevelQueue(new_order="drawn")
    places = {}
    for tid, V, tokens in ((1, None, 10), (2, None, 99), (3, None, 50), (4, 1, 5), (5, 1, 70)):
        places[tid] = q.push(tid, V, tokens, q.next_arrival())
    assert list(q.ids()) == [5, 4, 1, 2, 3] and len(q) == 5  # tagged level longest first, new ones as drawn
    q.remove(places[1])
    q.push(1, 1, 500, 1)  # routed, interrupted: it loops back into its level (its first arrival), longest first
    assert list(q.ids()) == [1, 5, 4, 2, 3]
    assert list(MultiLevelQueue().ids()) == []
    default = MultiLevelQueue()  # the default is the drawing order (issue 41)
    for tid, tokens in ((1, 10), (2, 99), (3, 50)):
        default.push(tid, None, tokens, default.next_arrival())
    assert list(default.ids()) == [1, 2, 3]
    longest = MultiLevelQueue(new_order="longest")  # the paper code's queue: new prompts longest first too
    for tid, tokens in ((1, 10), (2, 99), (3, 50)):
        longest.push(tid, None, tokens, longest.next_arrival())
    assert list(longest.ids()) == [2, 3, 1]


def test_new_order_is_checked():
    with pytest.raises(ValueError, match="new_order='shortest'"):
        MultiLevelQueue(new_order="shortest")


@pytest.mark.parametrize("new_order, first", [("longest", 31), ("drawn", 30)])
def test_the_coordinator_routes_new_prompts_in_the_configured_order(new_order, first):
    c, _ = make(n_inst=1, eta=1, version=0, max_concurrent=1, new_order=new_order)
    set_version(c, 0, 0)
    c.submit([traj(c, 30, 3, None, 20), traj(c, 31, 4, None, 60)])  # drawn first: the shorter prompt
    assert [r[0] for r in routes(c.tick(1.0))] == [first]


def test_the_flag_reaches_the_config():
    from staleflow.config.parse import parse
    from staleflow.config.run import RunConfig, resolve
    from staleflow.presets import PRESETS

    assert resolve(parse(RunConfig, [], PRESETS, default="smollm2-cpu", prog="t")).coordinator.new_order == "drawn"
    cfg = resolve(parse(RunConfig, ["--coordinator.new-order", "longest"], PRESETS, default="smollm2-cpu", prog="t"))
    assert cfg.coordinator.new_order == "longest"
    with pytest.raises(SystemExit):
        parse(RunConfig, ["--coordinator.new-order", "shortest"], PRESETS, default="smollm2-cpu", prog="t")
