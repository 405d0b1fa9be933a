"""The rollout worker's turn driver (workers/turns.py) on the built-in engine (issue 40, item 3).

A tiny CausalLM (CPU, greedy) talks to a test environment through TurnDriver, the piece the
rollout rank runs. The environment's state is the number of steps it has seen (so a resume must
replay the earlier turns to recreate it) and its step can be held on a gate (a tool that is still
running). A toy codec maps turn texts and observations to the tiny vocabulary; the chat-template
codec is F's (tests/test_tool_call_template.py) and runs in the end-to-end preset.

The acceptance check: a trajectory interrupted while its tool runs, written to a ring, read back
and resumed on ANOTHER instance (another engine at a newer weight version, a fresh environment)
keeps every per-token version and log-prob of its prefix, re-runs the unanswered tool call, has
V_traj = the version of its first token, is reserved/occupied/consumed by the staleness protocol
within eta, and trains with the masked loss equal to A1's independent recomputation.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import pytest
import torch
from test_multi_turn_engine import make_engine
from test_train_helpers import capture_grads, tiny_model, train_group
from test_trajectory_tokens import _reference_loss

from staleflow.config import EnvConfig, TrainConfig
from staleflow.env import EnvStep
from staleflow.protocol import StalenessManager, StalenessSpec
from staleflow.rollout import SamplingParams
from staleflow.servers import TrajectoryRing
from staleflow.train.trainer import Trainer
from staleflow.trajectory import ENV_LOGPROB, ENV_VERSION, Prompt, TrajectoryTokens, model_versions
from staleflow.workers.turns import TurnDriver, final_turn_ids, model_turns

PROMPT = [5, 17, 33, 8, 41, 9, 60, 12, 3, 77, 25]
VOCAB = 96  # test_keep_kv.ARGS


class ToyCodec:
    """Turn text = the token ids written out; an observation = 3 to 6 ids derived from its text."""

    eot = [2]
    stop_ids = {1, 2}

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)

    def observation(self, text, max_tokens):
        n = 3 + len(text) % 4
        return [70 + (len(text) + j) % 20 for j in range(n)][:max_tokens]


class CountingEnv:
    """Ends after ``done_at`` steps; its observation names the step count, its state. ``gate``: steps
    from index ``gate_at`` on wait for it (a tool still running). Every step's message is logged."""

    def __init__(self, log, done_at=3, gate=None, gate_at=1, reward=None):
        self.log, self.done_at, self.gate, self.gate_at, self.reward = log, done_at, gate, gate_at, reward
        self.steps = 0

    async def reset(self, prompt):
        self.log.append(("reset", prompt.prompt_ids))
        self.steps = 0

    async def step(self, message):
        self.log.append(("step", message))
        if self.gate is not None and self.steps >= self.gate_at:
            while not self.gate.is_set():
                await asyncio.sleep(0.001)
        self.steps += 1
        if self.steps >= self.done_at:
            return EnvStep("", done=True, reward=self.reward)
        return EnvStep(f"result {self.steps}", done=False, tool_calls=1, tool_s=0.001)


def driver(engine, make_env, emitted, **env_kw):
    cfg = EnvConfig(name="test", max_turns=env_kw.pop("max_turns", 4), **env_kw)
    return TurnDriver(engine, cfg, ToyCodec(), 6, 64, lambda *a: emitted.append(a), make_env=make_env)


def pump(eng, drv, until, limit=5000):
    """Step the engine and the driver (what RolloutWorker.run does) until ``until()``."""
    for _ in range(limit):
        if until():
            return
        if eng.has_unfinished():
            for out in eng.step():
                drv.on_turn(out)
        drv.poll()
        if not eng.has_unfinished():
            time.sleep(0.001)  # an env step runs in the env thread
    raise AssertionError("the driver did not get there")


def greedy():
    return SamplingParams(temperature=0.0, max_new_tokens=6)


def row():
    return Prompt(0, "q", "", list(PROMPT))


def check_turn_structure(t: TrajectoryTokens):
    t.validate()
    mask = t.mask_values()
    for j, m in enumerate(mask):
        if m == 0:
            assert t.behaviour_logprobs[j] == ENV_LOGPROB and t.versions[j] == ENV_VERSION


def test_multi_turn_driver_runs_turns_until_the_env_is_done():
    log, emitted = [], []
    eng = make_engine()
    drv = driver(eng, lambda: CountingEnv(log, done_at=3, reward=0.5), emitted)
    try:
        drv.start(7, row(), TrajectoryTokens(list(PROMPT)), greedy())
        pump(eng, drv, lambda: emitted)
    finally:
        drv.close()
    (rid, tokens, reason, partial, stats) = emitted[0]
    assert (rid, reason, partial) == (7, "stop", False)
    check_turn_structure(tokens)
    turns = model_turns(tokens)
    assert len(turns) == stats.turns == 3  # two observations between three model turns
    assert stats.tool_calls == 2 and stats.env_reward == 0.5 and stats.tool_s > 0
    assert [m for k, m in log if k == "step"] == [ToyCodec().decode(t) for t in turns]
    assert final_turn_ids(tokens) == turns[-1]
    assert not eng.stats().parked_ids and eng.kv_tokens() == 0  # released at the end


def test_multi_turn_driver_stops_at_max_turns_and_max_total_tokens():
    for kw, want_turns in [({"max_turns": 2}, 2), ({"max_total_tokens": 14}, None)]:
        log, emitted = [], []
        eng = make_engine()
        drv = driver(eng, lambda: CountingEnv(log, done_at=99), emitted, **kw)
        try:
            drv.start(3, row(), TrajectoryTokens(list(PROMPT)), greedy())
            pump(eng, drv, lambda: emitted)
        finally:
            drv.close()
        tokens, stats = emitted[0][1], emitted[0][4]
        check_turn_structure(tokens)
        if want_turns:
            assert stats.turns == len(model_turns(tokens)) == want_turns
        else:
            assert len(tokens.response_ids) <= 14
        assert not eng.stats().parked_ids


def test_multi_turn_step_timeout_becomes_an_observation():
    log, emitted = [], []
    eng = make_engine()
    gate = threading.Event()  # never set: the second step hangs past --env.step-timeout-s
    drv = driver(eng, lambda: CountingEnv(log, done_at=3, gate=gate, gate_at=1), emitted, step_timeout_s=0.05)
    try:
        drv.start(1, row(), TrajectoryTokens(list(PROMPT)), greedy())
        pump(eng, drv, lambda: emitted)
    finally:
        gate.set()
        drv.close()
    tokens, stats = emitted[0][1], emitted[0][4]
    check_turn_structure(tokens)
    assert stats.turns == 4 and stats.tool_calls == 3  # the timed-out call counts, the model read an error


def test_multi_turn_interrupted_while_the_tool_runs_resumes_on_another_instance_within_eta():
    eta = 1
    gate = threading.Event()
    log_a, log_b, emitted_a, emitted_b = [], [], [], []
    eng_a, eng_b = make_engine(), make_engine()  # two instances with the same weights...
    eng_a.version, eng_b.version = 3, 4  # ...instance B has pulled a newer version meanwhile
    drv_a = driver(eng_a, lambda: CountingEnv(log_a, done_at=3, gate=gate, gate_at=1), emitted_a)
    drv_b = driver(eng_b, lambda: CountingEnv(log_b, done_at=3, gate=gate, gate_at=1), emitted_b)
    ring = TrajectoryRing.create(f"mt_{uuid.uuid4().hex[:8]}_{os.getpid()}", 0, 1 << 16)
    try:
        drv_a.start(9, row(), TrajectoryTokens(list(PROMPT)), greedy())
        # run until turn 2's tool call is running (held on the gate): the sequence is parked in A
        pump(eng_a, drv_a, lambda: sum(k == "step" for k, _ in log_a) == 2 and 9 in eng_a.stats().parked_ids)
        assert drv_a.episodes[9].pending is not None and not drv_a.episodes[9].pending.done()
        # the worker's Interrupt: abort the parked sequence (its payload), forget the episode
        (out,) = eng_a.abort([9])
        ep = drv_a.forget(9)
        partial = out.tokens
        assert ep.stats.turns == 2 and ep.stats.tool_calls == 1
        assert partial.mask_values()[-1] == 1  # ends with the model's finished turn: the call is unanswered
        handle = ring.write(partial)
        rec = ring.read(handle).copy()  # what another rank reads to resume it
        gate.set()
        drv_b.start(9, row(), rec, greedy())
        pump(eng_b, drv_b, lambda: emitted_b)
    finally:
        gate.set()
        drv_a.close()
        drv_b.close()
        ring.close()
        ring.unlink()
    final, stats = emitted_b[0][1], emitted_b[0][4]
    check_turn_structure(final)
    n = len(partial.response_ids)
    assert final.response_ids[:n] == list(partial.response_ids)
    assert final.behaviour_logprobs[:n] == list(partial.behaviour_logprobs)
    assert final.versions[:n] == list(partial.versions)
    assert final.mask_values()[:n] == partial.mask_values()
    assert final.mask_values()[n] == 0  # the re-run call's observation follows the prefix
    a_msgs = [m for k, m in log_a if k == "step"]
    assert [m for k, m in log_b if k == "step"] == a_msgs + [ToyCodec().decode(model_turns(final)[-1])]
    assert log_b[0] == ("reset", PROMPT)  # replayed: reset, turn 1, then the unanswered turn 2 again
    versions = model_versions(final)
    assert set(versions[: partial.num_trained]) == {3} and set(versions[partial.num_trained :]) == {4}
    v_traj = versions[0]  # the version of the first generated token
    assert stats.turns == 3 == len(model_turns(final))

    # The protocol is untouched: the group (this trajectory and a sibling) is reserved at V_traj,
    # occupied after it finished and consumed from a buffer within [V_traj, V_traj + eta].
    sibling = make_engine()
    sibling.version = 3
    emitted_s = []
    drv_s = driver(sibling, lambda: CountingEnv([], done_at=2), emitted_s)
    try:
        drv_s.start(
            10, row(), TrajectoryTokens(list(PROMPT)), SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
        )
        pump(sibling, drv_s, lambda: emitted_s)
    finally:
        drv_s.close()
    m = StalenessManager(StalenessSpec(eta=eta, batch_size=1, group_size=2, version=3))
    for tid in (9, 10):
        m.reserve(tid, 0, v_traj)
    for tid in (9, 10):
        m.complete(tid)
    buf = m.occupy(0)
    assert v_traj <= buf <= v_traj + eta and m.ready_version() == buf
    assert sorted(m.consume(buf)) == [0]

    # ... and trained with the mask: the trainer's loss equals A1's independent recomputation.
    payloads = [[final, emitted_s[0][1]]]
    groups = [train_group(0, v_traj, [1.0, 0.0], payloads[0])]
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=64, loss_agg="token-mean", off_policy="tis-token", grad_clip=0.0)
    trainer = Trainer(tiny_model(seed=4, vocab=VOCAB), cfg)
    ref_model = tiny_model(seed=4, vocab=VOCAB)
    _, adv, _ = trainer.prepare(groups, payloads)
    capture_grads(trainer)
    metrics = trainer.step(groups, payloads)
    want = _reference_loss(ref_model, payloads[0], adv, cfg, "token-mean")
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert metrics["response_tokens"] == sum(t.num_trained for t in payloads[0])
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_multi_turn_resume_mid_turn_continues_the_turn():
    log, emitted = [], []
    eng = make_engine()
    drv = driver(eng, lambda: CountingEnv(log, done_at=2), emitted)
    try:
        drv.start(4, row(), TrajectoryTokens(list(PROMPT)), greedy())
        pump(eng, drv, lambda: len(model_turns(eng.seqs[4].tokens)) == 1 and eng.seqs[4].num_output == 2)
        (out,) = eng.abort([4])
        drv.forget(4)
        drv.start(4, row(), out.tokens.copy(), greedy())
        pump(eng, drv, lambda: emitted)
    finally:
        drv.close()
    tokens, stats = emitted[0][1], emitted[0][4]
    check_turn_structure(tokens)
    assert tokens.response_ids[:2] == list(out.tokens.response_ids)
    assert stats.turns == 2 == len(model_turns(tokens))
    assert [m for k, m in log if k == "step"][0] == ToyCodec().decode(model_turns(tokens)[0])


def test_multi_turn_template_codec_feeds_the_calculator_env():
    """The codec the ranks use (SmolLM2's tokenizer and template): a turn ending in its stop token is
    decoded with special tokens kept, the calculator env parses and runs the call, and the observation
    is the template's tool turn plus the next assistant header."""
    from staleflow.env import make_env, observation_tokens
    from staleflow.model.tokenizer import load_tokenizer
    from staleflow.workers.turns import TemplateCodec

    tok = load_tokenizer("smollm2-135m")
    codec = TemplateCodec(tok, "auto")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in codec.stop_ids and codec.tool_format == "qwen"
    turn = tok('<tool_call>\n{"name": "calculator", "arguments": {"expression": "19 + 24"}}\n</tool_call>')["input_ids"]
    text = codec.decode(list(turn) + [im_end])
    assert text.endswith("<|im_end|>")
    env = make_env(EnvConfig(name="calculator"))
    asyncio.run(env.reset(row()))
    step = asyncio.run(env.step(text))
    assert (step.observation, step.done, step.tool_calls, step.error) == ("43", False, 1, None)
    assert codec.observation("43", 256) == observation_tokens(tok, "qwen", "43", 256)
    assert "43" in tok.decode(codec.observation("43", 256))
