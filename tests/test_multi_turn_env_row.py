"""An environment resets from its data row: the row's answer and meta reach env.reset in a multi-turn
run, for training trajectories (on their Route, also after an interrupt) and for held-out prompts (on
the Evaluate), and travel nowhere in a run without an environment."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
from test_controller import deliver, make_loop, routed

from staleflow.control.messages import Evaluate, decode, encode
from staleflow.controller import Finished
from staleflow.coordinator.record import INTERRUPT
from staleflow.runtime.backend import RuntimeWorkload
from staleflow.runtime.evaluation import HeldOutEval
from staleflow.trajectory import Prompt, Route, TurnStats
from staleflow.workers.rollout import RolloutWorker

ROW = Prompt(7, "Sum the list.", "42", [5, 6, 7], {"tests": ["assert f() == 42"], "index": 3})


class RowWorkload:
    """The runtime's env_fields on a fixed row (the test's Prompts fake otherwise)."""

    def __init__(self, with_env: bool):
        self.inner = RuntimeWorkload.__new__(RuntimeWorkload)
        self.inner.with_env = with_env

    def next_prompt(self):
        return ROW

    def prompt_len(self, prompt):
        return len(prompt.prompt_ids)

    def prompt_ids(self, prompt):
        return list(prompt.prompt_ids)

    def env_fields(self, prompt):
        return self.inner.env_fields(prompt)

    def new_member(self):
        return 0, 0


def test_multi_turn_env_row_rides_on_every_route_of_an_env_run():
    loop, be = make_loop(n_inst=1, eta=1, B=1, N=2, migration=False)
    loop.workload = RowWorkload(with_env=True)
    loop.refill()
    loop.tick(be.now())
    first = routed(be)
    assert first and all(r.answer == "42" and r.meta == ROW.meta for r in first)
    assert first[0].meta is not ROW.meta  # a copy: the data row is never shared with a message
    a = first[0].traj_id
    loop.coord.sched.transition(a, INTERRUPT, reason="pull")  # the coordinator asked for it
    deliver(loop, be, Finished(a, 0, "partial-a", 5, partial=True, stats=TurnStats(1)))
    be.sent.clear()
    loop.tick(be.now() + 1)
    (again,) = routed(be)
    assert again.traj_id == a and again.partial == "partial-a" and again.answer == "42" and again.meta == ROW.meta
    back = decode(encode(msgspec.structs.replace(again, partial=None)))  # typed fields on the control plane
    assert back.answer == "42" and back.meta == {"tests": ["assert f() == 42"], "index": 3}


def test_multi_turn_env_row_stays_home_without_an_env():
    loop, be = make_loop(n_inst=1, eta=1, B=1, N=1)
    loop.workload = RowWorkload(with_env=False)
    loop.refill()
    loop.tick(be.now())
    (r,) = routed(be)[:1]
    assert r.answer == "" and r.meta == {} and r.prompt_ids == [5, 6, 7]


class Turns:
    """Records what the worker starts (the TurnDriver's entry point)."""

    def __init__(self):
        self.started = []

    def decode(self, ids):
        return "text:" + ",".join(map(str, ids))

    def start(self, request_id, prompt, tokens, params):
        self.started.append((request_id, prompt, list(tokens.prompt_ids), params))


def _worker():
    w = RolloutWorker.__new__(RolloutWorker)
    w.turns, w.params = Turns(), {"max_new_tokens": 8}
    w.net, w.engine = None, SimpleNamespace(add=lambda r: (_ for _ in ()).throw(AssertionError("not via turns")))
    return w


def test_multi_turn_env_row_reaches_the_env_reset_prompt():
    w = _worker()
    w.route(Route(11, 0, 0, prompt_ids=[5, 6, 7], prompt_len=3, seed=4, answer="42", meta={"tests": ["t"]}))
    ((rid, row, ids, params),) = w.turns.started
    assert (rid, row.prompt_id, row.answer, row.meta, ids) == (11, 11, "42", {"tests": ["t"]}, [5, 6, 7])
    assert row.text == "text:5,6,7" and params.seed == 4
    w.route(Route(12, 0, 0, prompt_ids=[5], prompt_len=1))  # no env row sent: empty answer and meta
    assert (w.turns.started[1][1].answer, w.turns.started[1][1].meta) == ("", {})


def test_multi_turn_env_row_reaches_held_out_prompts():
    sent = []
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    prompts = [ROW, Prompt(8, "q", "9", [1, 2], {"index": 4})]
    HeldOutEval(prompts, "arithmetic", tok, 8, with_env=True).start(0, [1], lambda rank, msg: sent.append(msg))
    (msg,) = sent
    msg = decode(encode(msg))
    assert isinstance(msg, Evaluate) and msg.answers == ["42", "9"] and msg.metas[1] == {"index": 4}
    w = _worker()
    w.evaluate(msg)
    assert [(row.answer, row.meta) for _, row, _, _ in w.turns.started] == [("42", ROW.meta), ("9", {"index": 4})]
    sent.clear()
    HeldOutEval(prompts, "arithmetic", tok, 8).start(0, [1], lambda rank, msg: sent.append(msg))
    assert sent[0].answers == [] and sent[0].metas == []  # no environment: nothing extra on the wire
