"""The controller loop's side of multi-turn trajectories (issue 40, item 3): a Finished carries turns,
tool calls and tool seconds; the ledger sums a trajectory's tool seconds over its partial records
(it may run on several instances); an environment's own reward replaces the task's scoring; the
step's metrics (metrics.jsonl) report turns, tool calls and tool seconds per trajectory, and only
in runs that have them; report.png draws them."""

from __future__ import annotations

import json

import pytest
from test_controller import deliver, make_loop, routed

from staleflow.controller import Finished, Rewarded, TrainDone
from staleflow.coordinator.record import INTERRUPT
from staleflow.metrics.report import make_report
from staleflow.trajectory import TurnStats


def test_multi_turn_loop_counts_turns_tools_and_takes_the_env_reward():
    loop, be = make_loop(n_inst=1, eta=1, B=1, N=2, migration=False)
    loop.refill()
    loop.tick(be.now())
    group = loop.ledger.groups[loop.ledger.trajs[routed(be)[0].traj_id].group_id]
    a, b = group.members
    loop.coord.sched.transition(a, INTERRUPT, reason="pull")  # the coordinator asked for it
    deliver(loop, be, Finished(a, 0, "partial-a", 5, partial=True, stats=TurnStats(2, 1, 0.25)))
    assert loop.ledger.trajs[a].turns == TurnStats(2, 1, 0.25)
    be.sent.clear()
    loop.tick(be.now() + 1)
    assert [r.traj_id for r in routed(be)] == [a] and routed(be)[0].partial == "partial-a"  # resumes
    deliver(loop, be, Finished(a, 0, "rec-a", 9, stats=TurnStats(3, 2, 0.5, env_reward=1.0)))
    deliver(loop, be, Finished(b, 0, "rec-b", 7, stats=TurnStats(1)))
    assert a not in be.scored and b in be.scored  # the environment rewarded a; the task's fn scores b
    deliver(loop, be, Rewarded(b, 0.0))
    loop.maybe_train()
    ((version, batch),) = be.trained
    assert sorted(zip(batch[0].traj_ids, batch[0].rewards)) == [(a, 1.0), (b, 0.0)]
    got = []
    loop.on_step = lambda rec, m: got.append(m)
    deliver(loop, be, TrainDone(1))
    (m,) = got
    assert m["turns_mean"] == 2.0 and m["tool_calls_per_traj"] == 1.0
    assert m["tool_s_per_traj"] == pytest.approx(0.375) and m["tool_s_total"] == pytest.approx(0.75)


def test_multi_turn_keys_only_in_runs_with_an_environment(tmp_path):
    loop, be = make_loop(n_inst=1, eta=1, B=1, N=1, migration=False)
    be.reward = 1.0
    loop.refill()
    loop.tick(be.now())
    deliver(loop, be, Finished(routed(be)[0].traj_id, 0, "rec", 4))
    loop.maybe_train()
    got = []
    loop.on_step = lambda rec, m: got.append(m)
    deliver(loop, be, TrainDone(1))
    assert not {"turns_mean", "tool_calls_per_traj", "tool_s_per_traj"} & set(got[0])

    rows = [dict(got[0], step=0), dict(got[0], step=1, turns_mean=2.5, tool_calls_per_traj=1.5, tool_s_per_traj=0.2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "timeline.jsonl").write_text("")
    assert make_report(str(tmp_path)).endswith("report.png") and (tmp_path / "report.png").stat().st_size > 0
