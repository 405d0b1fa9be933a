"""A Pull that lands while a multi-turn trajectory waits on its tool (the rollout rank, the turn driver and
the coordinator together, on the built-in engine; coordinator/pull.py, workers/turns.py "pull").

The rank's snapshot names the trajectory as parked; the coordinator's pull sends no Interrupt for it; the
rank's pull loads the new weights and frees the parked KV; the tool call returns and the next turn
re-prefills the whole prefix plus the observation under the new weights, on the same instance. Checked: the
call ran once, the trajectory finished there (the coordinator counts it), the turn after the pull carries
the new version and equals a one-shot greedy generation of the new weights from the same history (with the
old-weight KV kept, as keep-KV does, it would not), and the payload is valid. The race (the coordinator,
a tick behind, still thinks it parked while it decodes again) ends in a loop-back the coordinator takes.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from test_coordinator import loop_back, make, traj
from test_multi_turn_engine import make_engine, one_shot
from test_multi_turn_worker import PROMPT, CountingEnv, ToyCodec, check_turn_structure

from staleflow.cluster.roles import Roles
from staleflow.config import CoordinatorConfig, EnvConfig
from staleflow.coordinator import Interrupt, Pull
from staleflow.servers import TrajectoryRing
from staleflow.trajectory import Finished, Route, model_versions
from staleflow.workers.rollout import RolloutWorker, keeps_kv_on_pull
from staleflow.workers.turns import TurnDriver, model_turns


class Rank:
    """A RolloutWorker on a built-in engine at version 0 whose weight source serves another model as
    version 1, with a turn driver and a gated CountingEnv; what it sends is recorded."""

    def __init__(self, keep_kv: bool = False):
        self.log, self.sent, self.gate = [], [], threading.Event()
        self.new = make_engine(seed=1).model
        w = self.w = RolloutWorker.__new__(RolloutWorker)
        w.engine, w.instance, w.net, w.unsent, w.crossed, w.waiting_fetch = make_engine(), 0, None, [], {}, []
        w.weights = SimpleNamespace(load=self._load)
        w.keep_on_pull = keeps_kv_on_pull(CoordinatorConfig(keep_kv_on_pull=keep_kv))
        w.params = dict(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=6)
        w.ring = TrajectoryRing.create(f"mtp_{uuid.uuid4().hex[:8]}_{os.getpid()}", 0, 1 << 16)
        client = SimpleNamespace(send=self.sent.append, send_stats=self.sent.append)
        w.ctx = SimpleNamespace(client=client, roles=Roles(3, 2), rank=1, run_id="x")
        w._last_tokens, w._last_t, w._last_stats = 0, time.monotonic(), 0.0
        make_env = lambda: CountingEnv(self.log, done_at=3, gate=self.gate, gate_at=1)  # noqa: E731
        w.turns = TurnDriver(w.engine, EnvConfig(name="test", max_turns=4), ToyCodec(), 6, 64, w._emit_turns, make_env)

    def _load(self, engine, keep_kv):
        engine.load_weights(dict(self.new.named_parameters()), 1, keep_kv=keep_kv)
        return 1, 0, {}  # (version, bytes, {source node: bytes})

    def pump(self, until, limit=5000):
        """What RolloutWorker.run does between commands: step the engine, poll the env steps."""
        w = self.w
        for _ in range(limit):
            if until():
                return
            if w.engine.has_unfinished():
                for out in w.engine.step():
                    w.on_output(out)
            w.turns.poll()
            if not w.engine.has_unfinished():
                time.sleep(0.001)
        raise AssertionError("the rank did not get there")

    def steps(self) -> int:
        return sum(k == "step" for k, _ in self.log)

    def finished(self) -> list[Finished]:
        return [m for m in self.sent if isinstance(m, Finished)]

    def snapshot(self):
        self.w.send_stats(time.monotonic())
        return self.sent[-1]

    def close(self):
        self.gate.set()
        self.w.turns.close()
        self.w.ring.close()
        self.w.ring.unlink()


def parked_at_second_call(keep_kv: bool = False):
    """A rank and a coordinator with trajectory 9 routed to instance 0 and parked on its second tool call;
    the coordinator has taken the rank's snapshot and version 1 is published."""
    rank = Rank(keep_kv)
    c, m = make(n_inst=1, eta=1, pull="greedy", keep_kv_on_pull=keep_kv)
    c.submit([traj(c, 9, 9, None, len(PROMPT))])
    (route,) = c.tick(1.0)
    rank.w.handle(Route(9, 0, route.traj_version, prompt_ids=list(PROMPT), prompt_len=len(PROMPT), seed=3))
    eng = rank.w.engine
    rank.pump(lambda: rank.steps() == 2 and 9 in eng.stats().parked_ids)
    snap = rank.snapshot()
    assert (snap.running, snap.waiting, snap.traj_ids, snap.parked_ids) == (0, 0, (9,), (9,))
    assert c.on_snapshot(snap) and c.instances[0].parked == {9}
    m.version = 1
    c.on_new_version(1)
    return rank, c


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_pull_while_the_tool_runs_leaves_the_trajectory_and_its_next_turn_uses_the_new_weights(keep_kv):
    rank, c = parked_at_second_call(keep_kv)
    eng = rank.w.engine
    try:
        cmds = c.tick(2.0)
        assert cmds == [Pull(0, 1)]  # no Interrupt: it waits on its tool
        held = eng.kv_tokens()
        for cmd in cmds:
            rank.w.handle(cmd)
        assert eng.version == 1 and 9 in eng.stats().parked_ids and not rank.finished()
        assert eng.kv_tokens() == (held if keep_kv else 0)  # the old-weight KV is freed (kept with keep-KV)
        assert not rank.w.turns.episodes[9].pending.done()  # its call is still running
        c.on_pull_done(0, 1)
        rank.gate.set()
        rank.pump(lambda: rank.finished())
        (fin,) = rank.finished()
        rec = rank.w.ring.read(fin.handle).copy()  # what the trainer reads
    finally:
        rank.close()
    assert (fin.traj_id, fin.instance, fin.partial) == (9, 0, False)
    assert c.on_finished(0, 9) and c.counters["interrupted"] == 0
    assert c.counters["pull_kept_parked"] == (0 if keep_kv else 1)  # keep-KV interrupts nothing anyway
    assert rank.steps() == 3 and [k for k, _ in rank.log].count("reset") == 1  # each call ran once
    assert fin.stats.tool_calls == 2 and fin.stats.turns == 3
    check_turn_structure(rec)
    turns = model_turns(rec)
    assert len(turns) == 3
    versions = model_versions(rec)
    n_last = len(turns[-1])
    assert set(versions[:-n_last]) == {0} and set(versions[-n_last:]) == {1}  # V_traj 0, post-pull turn at 1
    history = list(rec.prompt_ids) + list(rec.response_ids[: len(rec.response_ids) - n_last])
    ref, _ = one_shot(history, n_last, seed=1)  # the new weights, the whole history prefilled
    lp = list(rec.behaviour_logprobs[-n_last:])
    if keep_kv:  # the prefix's KV came from the old weights: not what the new weights alone compute
        assert lp != pytest.approx(list(ref.tokens.behaviour_logprobs), rel=1e-4, abs=1e-5)
    else:
        assert list(rec.response_ids[-n_last:]) == list(ref.tokens.response_ids)
        assert lp == pytest.approx(list(ref.tokens.behaviour_logprobs), rel=1e-4, abs=1e-5)


def test_a_pull_that_finds_a_thought_parked_trajectory_decoding_again_loops_it_back():
    rank, c = parked_at_second_call()
    eng = rank.w.engine
    try:
        rank.gate.set()  # the call returns after the snapshot: the next turn is prefilling / decoding
        rank.pump(lambda: 9 in eng.stats().running_ids or 9 in eng.stats().waiting_ids)
        cmds = c.tick(2.0)
        assert cmds == [Pull(0, 1)] and not any(isinstance(x, Interrupt) for x in cmds)
        rank.w.handle(cmds[0])  # the rank's pull interrupts what runs in its engine
        (fin,) = rank.finished()
        assert (fin.traj_id, fin.partial) == (9, True) and 9 not in rank.w.turns.episodes
        check_turn_structure(rank.w.ring.read(fin.handle))
    finally:
        rank.close()
    loop_back(c, 0, 9, fin.n_tokens)  # the loop records it and reports the loop-back nobody asked for
    assert c.instance_of(9) == -1 and c.records[9].reserved and list(c.queue.ids()) == [9]
    c.on_pull_done(0, 1)
    assert [(r.traj_id, r.traj_version) for r in c.tick(3.0) if isinstance(r, Route)] == [(9, 0)]
