"""The engine side of turns (issue 40, item 3): Request.hold, engine.extend, engine.release.

A held request's turn returns its output and keeps its KV (parked); extend appends the environment's
observation (loss_mask 0) and prefills ONLY the turn's last sampled token and the observation, after
the cached history. Checked here on the built-in engine (tiny CausalLM, CPU, greedy):
- tokens and log-probs of a multi-turn request equal a one-shot request whose prompt is the whole
  history, and the model tokens' log-probs equal an independent fp64 full-sequence forward;
- the prefilled token counts (CostSample.prefill_tokens) prove the history is not re-prefilled;
- the observation tokens carry loss_mask 0, ENV_LOGPROB and ENV_VERSION;
- without a model, a hypothesis driver plays the engine with turns, tool waits, releases, aborts
  and weight loads over a small cache: every fed sequence reads back its own context (parked K/V
  is never handed to another sequence, reclaimed K/V is recomputed), nothing starves;
- release frees the blocks, abort of a parked request returns its payload, a pull with keep_kv keeps
  a parked sequence's old-weight K/V (mixed-cache reference from test_keep_kv), a pull without it
  and a reclaim of idle K/V (the preemption path) re-prefill the history on extend, and a parked
  trajectory aborted and resumed on another engine gives the same tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_keep_kv import ARGS, Mixed, Recording, _logprobs, _models

from staleflow.model import CausalLM, ModelArgs
from staleflow.rollout import BuiltinEngine, EngineError, Request, SamplingParams
from staleflow.rollout.block_manager import BlockManager
from staleflow.rollout.prefix_sharing import SharingBlockManager
from staleflow.rollout.scheduler import Scheduler
from staleflow.rollout.sequence import Sequence, SequenceStatus
from staleflow.trajectory import ENV_LOGPROB, ENV_VERSION

PROMPT = [5, 17, 33, 8, 41, 9, 60, 12, 3, 77, 25]  # 11 tokens: crosses blocks of 4 and chunks of 8
OBS = [[70, 71, 72, 73, 74, 75, 76, 78, 79], [80, 81, 82]]  # observations after turns 1 and 2
TURN = [6, 5, 4]  # max_new_tokens of each turn


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def make_engine(seed: int = 0, **kw) -> BuiltinEngine:
    model = CausalLM(ModelArgs(**ARGS, eos_token_ids=[1])).init_weights(std=0.2, seed=seed)
    kw = {"max_kv_tokens": 512, "block_size": 4, "prefill_chunk_tokens": 8, "max_model_len": 64, **kw}
    return BuiltinEngine(model, profile=True, **kw)


def run_turn(eng: BuiltinEngine, rid):
    """Step until `rid`'s turn stops; returns (its output, tokens prefilled meanwhile)."""
    start = len(eng.profile_samples)
    for _ in range(200):
        for out in eng.step():
            if out.request_id == rid:
                return out, sum(s.prefill_tokens for s in eng.profile_samples[start:])
    raise AssertionError(f"request {rid!r} did not stop")


def one_shot(history: list[int], n: int, seed: int = 0, **kw):
    """A fresh engine, the whole history as the prompt: (output, tokens prefilled)."""
    eng = make_engine(seed, **kw)
    eng.add(Request("ref", history, greedy(n)))
    return run_turn(eng, "ref")


@pytest.mark.parametrize("backend", ["mirror", "gather"])
@pytest.mark.parametrize("sharing", [True, False])
def test_multi_turn_extend_prefills_only_the_observation_and_equals_a_one_shot_prefill(backend, sharing):
    eng = make_engine(decode_backend=backend, prefix_sharing=sharing)
    eng.add(Request("t", PROMPT, greedy(TURN[0]), hold=True))
    eng.add(Request("other", PROMPT[:7], greedy(9)))  # a plain request shares the batch (and prompt blocks)
    out, prefilled = run_turn(eng, "t")
    assert out.finish_reason == "length" and len(out.tokens.response_ids) == TURN[0]
    history = PROMPT + out.tokens.response_ids
    for turn in (1, 2):
        n_before = len(history)
        eng.extend("t", OBS[turn - 1], max_new_tokens=TURN[turn])
        out, prefilled = run_turn(eng, "t")
        if sharing:  # reference counts equal the block tables, parked sequence included
            eng.block_manager.check(eng.seqs.values())
        # only the turn's last sampled token (no K/V yet) and the observation are prefilled
        assert prefilled == 1 + len(OBS[turn - 1]), (turn, prefilled)
        history = history + OBS[turn - 1]
        new = out.tokens.response_ids[len(history) - len(PROMPT) :]
        assert len(new) == TURN[turn]
        ref, ref_prefilled = one_shot(history, TURN[turn], decode_backend=backend, prefix_sharing=sharing)
        assert ref_prefilled == len(history) > n_before  # the one-shot request re-prefills everything
        assert new == ref.tokens.response_ids, f"turn {turn}: tokens differ from a one-shot prefill of the history"
        got_lp = out.tokens.behaviour_logprobs[len(history) - len(PROMPT) :]
        torch.testing.assert_close(got_lp, ref.tokens.behaviour_logprobs, atol=1e-5, rtol=0)
        history = history + new
    while eng.has_unfinished():  # the plain request finishes
        eng.step()

    t = out.tokens
    t.validate()
    n1, n2 = TURN[0], TURN[0] + len(OBS[0]) + TURN[1]
    mask = [1] * n1 + [0] * len(OBS[0]) + [1] * TURN[1] + [0] * len(OBS[1]) + [1] * TURN[2]
    assert t.loss_mask == mask and t.prompt_ids == PROMPT and PROMPT + t.response_ids == history
    env = [j for j, m in enumerate(mask) if m == 0]
    assert [t.response_ids[j] for j in env] == OBS[0] + OBS[1]
    assert all(t.behaviour_logprobs[j] == ENV_LOGPROB and t.versions[j] == ENV_VERSION for j in env)
    assert all(t.versions[j] == 0 for j in range(len(mask)) if mask[j])
    assert t.num_trained == sum(TURN) and t.response_ids[n1 : n1 + len(OBS[0])] == OBS[0]
    assert t.response_ids[n2 : n2 + len(OBS[1])] == OBS[1]
    # independent check: every model token's log-prob from one fp64 full-sequence forward
    old, _ = _models()
    want = _logprobs(old, history, Recording())[len(PROMPT) - 1 :]
    got = torch.tensor(t.behaviour_logprobs, dtype=torch.float64)
    keep = torch.tensor(mask, dtype=torch.bool)
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=0)


def test_multi_turn_parked_kv_is_counted_and_release_frees_the_blocks():
    eng = make_engine(prefix_sharing=False)
    free0 = eng.block_manager.num_free
    eng.add(Request("t", PROMPT, greedy(TURN[0]), hold=True))
    out, _ = run_turn(eng, "t")
    seq_len = len(PROMPT) + TURN[0]
    st = eng.stats()
    assert (st.num_parked, st.parked_ids, st.num_running, st.num_waiting) == (1, ["t"], 0, 0)
    assert st.kv_tokens == seq_len - 1  # the last sampled token's K/V is computed on extend
    assert eng.block_manager.num_free == free0 - (-(-(seq_len - 1) // 4))
    assert not eng.has_unfinished() and eng.step() == []  # a parked request is not scheduled
    eng.add(Request("r", PROMPT, greedy(20)))
    eng.step()
    with pytest.raises(EngineError, match="running, not parked: abort it instead"):
        eng.release("r")
    eng.abort(["r"])
    eng.release("t")
    assert eng.block_manager.num_free == free0 and eng.stats().num_parked == 0 and eng.stats().kv_tokens == 0
    with pytest.raises(EngineError, match="unknown here"):
        eng.release("t")
    eng.release("t", missing_ok=True)
    with pytest.raises(EngineError, match="unknown request_id"):
        eng.extend("t", OBS[0], 4)


def test_multi_turn_bad_extend_changes_nothing():
    eng = make_engine()
    eng.add(Request("plain", PROMPT, greedy(30)))
    eng.add(Request("t", PROMPT, greedy(TURN[0]), hold=True))
    with pytest.raises(EngineError, match="still generating"):
        eng.extend("t", OBS[0], 4)
    out, _ = run_turn(eng, "t")
    with pytest.raises(EngineError, match="not held here"):
        eng.extend("plain", OBS[0], 4)  # not a hold request
    before = eng.seqs["t"].tokens.copy()
    with pytest.raises(EngineError, match="max_model_len=64"):
        eng.extend("t", [7] * 60, 4)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        eng.extend("t", [7, 96], 4)
    with pytest.raises(EngineError, match="max_new_tokens=0"):
        eng.extend("t", [7], 0)
    assert eng.seqs["t"].tokens == before and eng.stats().parked_ids == ["t"]
    eng.extend("t", [], 3)  # an empty observation just continues the turn
    out2, prefilled = run_turn(eng, "t")
    assert prefilled == 1 and out2.tokens.response_ids[: TURN[0]] == out.tokens.response_ids
    ref, _ = one_shot(PROMPT, TURN[0] + 3)
    assert out2.tokens.response_ids == ref.tokens.response_ids


def test_multi_turn_abort_of_a_parked_request_returns_its_payload_and_resumes_elsewhere():
    eng = make_engine()
    eng.add(Request("t", PROMPT, greedy(TURN[0]), hold=True))
    out, _ = run_turn(eng, "t")
    free_parked = eng.block_manager.num_free
    (aborted,) = eng.abort(["t"])
    assert aborted.finish_reason == "abort" and aborted.tokens == out.tokens
    assert eng.block_manager.num_free > free_parked and "t" not in eng.seqs
    # resumed on another instance (the K/V not moved): observation appended, the history re-prefilled
    other = make_engine()
    tokens = aborted.tokens.copy()
    tokens.append_observation(OBS[0])
    n_out = len(tokens.response_ids)
    other.add(Request("t", tokens, greedy(n_out + TURN[1]), hold=True))
    moved, prefilled = run_turn(other, "t")
    assert prefilled == len(PROMPT) + n_out
    # the same turn on the first engine, its K/V kept
    eng.add(Request("u", PROMPT, greedy(TURN[0]), hold=True))
    run_turn(eng, "u")
    eng.extend("u", OBS[0], TURN[1])
    kept, _ = run_turn(eng, "u")
    assert moved.tokens.response_ids == kept.tokens.response_ids and moved.tokens.loss_mask == kept.tokens.loss_mask
    torch.testing.assert_close(moved.tokens.behaviour_logprobs, kept.tokens.behaviour_logprobs, atol=1e-5, rtol=0)
    # aborting after extend, before the turn ran, returns the observation too
    eng.add(Request("w", PROMPT, greedy(TURN[0]), hold=True))
    run_turn(eng, "w")
    eng.extend("w", OBS[1], 2)
    (w,) = eng.abort(["w"])
    assert w.tokens.response_ids[-len(OBS[1]) :] == OBS[1] and w.tokens.loss_mask[-len(OBS[1]) :] == [0] * 3
    eng.release("u")
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_multi_turn_returned_requests_are_copies_and_the_callers_request_is_never_touched():
    """The engine's output is the finished Request: a copy of the engine's own (made at add), so a
    held request the engine keeps extending never aliases a turn it returned; a Sequence holds no
    trajectory data, only KV/scheduling state (a speculative step's unverified draft included: never
    part of the payload) and a reference to that request."""
    slots = ("request", "num_computed", "block_table", "status", "arrival", "kv_epoch", "draft")
    assert Sequence.__slots__ == slots
    eng = make_engine()
    caller = Request("t", PROMPT, greedy(TURN[0]), hold=True)
    eng.add(caller)
    own = eng.seqs["t"].request
    assert own is not caller and own.tokens is not caller.tokens and isinstance(own.seed, int)
    first, _ = run_turn(eng, "t")
    assert caller.tokens.response_ids == [] and caller.seed is None and caller.finish_reason is None
    assert first is not own and first.tokens.response_ids is not own.tokens.response_ids
    assert (first.finish_reason, first.seed, own.finish_reason) == ("length", own.seed, "length")
    kept = first.tokens.copy()
    eng.extend("t", OBS[0], TURN[1])
    assert own.finish_reason is None and len(own.tokens.response_ids) == TURN[0] + len(OBS[0])
    second, _ = run_turn(eng, "t")
    assert first.tokens == kept and first.finish_reason == "length"  # the engine extended its own copy only
    assert second.tokens.response_ids[: TURN[0]] == kept.response_ids and second.seed == first.seed


def test_a_returned_request_resumes_with_its_seed():
    """A request added without a seed gets one drawn at add; the partial Request abort returns carries
    it, and re-adding that Request continues the same random stream (its finish_reason is ignored)."""
    sampled = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    eng = make_engine()
    eng.add(Request("x", PROMPT, sampled))  # takes the first draw: a fresh engine would not draw s's seed again
    eng.abort(["x"])
    eng.add(Request("s", PROMPT, sampled))
    while eng.seqs["s"].num_output < 4:
        assert eng.step() == []
    (part,) = eng.abort(["s"])
    assert part.finish_reason == "abort" and part.params.seed is None and isinstance(part.seed, int)
    (resumed,) = make_engine().generate([part])
    assert resumed.finish_reason == "length" and resumed.seed == part.seed and part.finish_reason == "abort"
    (whole,) = make_engine().generate([Request("s", PROMPT, dataclasses.replace(sampled, seed=part.seed))])
    assert resumed.tokens.response_ids == whole.tokens.response_ids
    assert resumed.tokens.response_ids[:4] == part.tokens.response_ids[:4]


def test_multi_turn_pull_with_keep_kv_keeps_the_parked_kv():
    old, new = _models()
    eng = make_engine(prefill_chunk_tokens=64)
    eng.add(Request("t", PROMPT, greedy(TURN[0]), hold=True))
    out, _ = run_turn(eng, "t")
    cut = eng.seqs["t"].num_computed
    assert cut == len(PROMPT) + TURN[0] - 1
    eng.load_weights(dict(new.named_parameters()), version=1, keep_kv=True)
    assert eng.stats().kv_tokens == cut  # the parked K/V survives the pull
    eng.extend("t", OBS[0], TURN[1])
    out, prefilled = run_turn(eng, "t")
    assert prefilled == 1 + len(OBS[0])
    t = out.tokens
    n = TURN[0] + len(OBS[0])
    assert t.versions == [0] * TURN[0] + [ENV_VERSION] * len(OBS[0]) + [1] * TURN[1]
    tokens = PROMPT + t.response_ids
    rec = Recording()
    _logprobs(old, tokens, rec)
    want_mixed = _logprobs(new, tokens, Mixed(rec.kv, cut))[len(PROMPT) - 1 :]
    want_new = _logprobs(new, tokens, Recording())[len(PROMPT) - 1 :]
    got = torch.tensor(t.behaviour_logprobs, dtype=torch.float64)
    torch.testing.assert_close(got[n:], want_mixed[n:], atol=2e-5, rtol=0)
    assert (want_mixed[n:] - want_new[n:]).abs().max() > 1e-3  # the reference tells kept from re-prefilled K/V


def test_multi_turn_pull_without_keep_kv_re_prefills_the_history_on_extend():
    _, new = _models()
    eng = make_engine()
    eng.add(Request("t", PROMPT, greedy(TURN[0]), hold=True))
    out, _ = run_turn(eng, "t")
    eng.load_weights(dict(new.named_parameters()), version=1, keep_kv=False)
    assert eng.stats().kv_tokens == 0 and eng.block_manager.num_free == eng.block_manager.num_blocks
    eng.extend("t", OBS[0], TURN[1])
    out, prefilled = run_turn(eng, "t")
    history = PROMPT + out.tokens.response_ids[: TURN[0] + len(OBS[0])]
    assert prefilled == len(history)
    got = torch.tensor(out.tokens.behaviour_logprobs[-TURN[1] :], dtype=torch.float64)
    want = _logprobs(new, PROMPT + out.tokens.response_ids, Recording())[-TURN[1] :]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_multi_turn_idle_kv_is_reclaimed_before_running_sequences_are_preempted():
    # 16 blocks of 4 tokens: the parked request (16 K/V tokens, 4 blocks) must give way to a 60-token one
    eng = make_engine(max_kv_tokens=64, prefill_chunk_tokens=64, prefix_sharing=False)
    eng.add(Request("t", PROMPT, greedy(TURN[0]), hold=True))
    first, _ = run_turn(eng, "t")
    eng.add(Request("big", list(range(2, 52)), greedy(9)))
    big, _ = run_turn(eng, "big")
    assert eng.scheduler.num_reclaimed >= 1 and eng.scheduler.num_preemptions == 0
    assert eng.seqs["t"].block_table == [] and eng.stats().parked_ids == ["t"]
    eng.extend("t", OBS[0], TURN[1])
    out, prefilled = run_turn(eng, "t")
    history = PROMPT + first.tokens.response_ids + OBS[0]
    assert prefilled == len(history)  # reclaimed: re-prefilled whole
    ref, _ = one_shot(history, TURN[1])
    assert out.tokens.response_ids[-TURN[1] :] == ref.tokens.response_ids
    assert big.tokens.response_ids == one_shot(list(range(2, 52)), 9)[0].tokens.response_ids


def drive_turns(num_blocks, block_size, max_running, budget, sharing, trajs, loads, aborts):
    """Play the engine's loop on the Scheduler alone (the cache modelled slot by slot, as in
    test_engine_prefix_sharing.drive): each trajectory runs turns of `new` tokens, waits `wait`
    steps for its tool while parked, and is extended with `obs` tokens; its last turn is released."""
    bm = (SharingBlockManager if sharing else BlockManager)(num_blocks, block_size)
    sch = Scheduler(bm, max_running, budget)
    max_len = num_blocks * block_size
    live, turns_left, wake = {}, {}, {}
    for i, (plen, turns, new, _obs, _wait) in enumerate(trajs):
        prompt = [3 + i % 2] + [5 + (i * 7 + j) % 11 for j in range(min(plen, max_len - 2) - 1)]
        seq = Sequence(Request(i, prompt, SamplingParams(max_new_tokens=new), hold=True, seed=i), arrival=i)
        sch.add(seq)
        live[i], turns_left[i] = seq, turns - 1
    slots: dict[int, tuple] = {}
    floor = dict.fromkeys(live, 0)  # the oldest weight version a sequence may read
    version = 0
    for step in range(4000):
        if not live:
            break
        for i in aborts.get(step, []):
            if i in live:
                sch.remove(live.pop(i))
                wake.pop(i, None)
        for i, (t, obs, new) in list(wake.items()):  # tools answered: the next turn
            if step >= t:
                seq = live[i]
                seq.tokens.append_observation([90 + (i + k) % 5 for k in range(obs)])
                seq.request.params = dataclasses.replace(seq.params, max_new_tokens=seq.num_output + new)
                sch.resume(seq)
                del wake[i]
        if step in loads:
            if loads[step] and sharing:
                bm.retire_prefixes()
            elif not loads[step]:
                sch.evict_all_kv()
                floor = dict.fromkeys(floor, version + 1)
            version += 1
        fresh = {s.request_id for s in sch.waiting if not s.block_table}
        batch = sch.schedule()
        floor.update({s.request_id: version for s in batch.seqs if s.request_id in fresh})
        assert len(batch) or not sch.has_unfinished(), "nothing scheduled while sequences wait"
        assert batch.prefill_tokens <= budget
        for seq, k in zip(batch.seqs, batch.num_tokens):
            for pos in range(seq.num_computed, seq.num_computed + k):
                slots[bm.slot(seq, pos)] = (version, tuple(seq.token_slice(0, pos + 1)))
        for seq, k in zip(batch.seqs, batch.num_tokens):
            for pos in range(seq.num_computed + k):
                ver, prefix = slots.get(bm.slot(seq, pos), (-1, None))
                assert prefix == tuple(seq.token_slice(0, pos + 1)) and ver >= floor[seq.request_id], (
                    f"request {seq.request_id} position {pos} reads K/V it does not own"
                )
        for seq, k in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += k
        for seq in batch.seqs:
            if seq.num_computed == len(seq):
                seq.append(40 + (seq.request_id * 13 + seq.num_output) % 37, -1.0, version)
                if seq.num_output >= seq.params.max_new_tokens or len(seq) >= max_len:
                    i = seq.request_id
                    _, _, new, obs, wait = trajs[i]
                    if turns_left[i] and len(seq) + obs < max_len:
                        sch.park(seq)  # the turn stopped: K/V kept while the tool runs
                        assert seq.status is SequenceStatus.PARKED and seq.num_computed == len(seq) - 1
                        turns_left[i] -= 1
                        wake[i] = (step + 1 + wait, obs, new)
                    else:
                        sch.remove(seq)  # the trajectory ended: release
                        del live[i]
        if sharing:
            bm.check(live.values())
        for s in live.values():
            assert len(s.block_table) * block_size >= s.num_computed
    assert not live, "trajectories starved"
    assert bm.num_free == num_blocks
    return sch


@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(6, 24),
    block_size=st.sampled_from([1, 2, 4]),
    max_running=st.integers(1, 6),
    budget=st.integers(1, 16),
    sharing=st.booleans(),
    trajs=st.lists(
        st.tuples(st.integers(1, 12), st.integers(1, 4), st.integers(1, 5), st.integers(0, 6), st.integers(0, 4)),
        min_size=1,
        max_size=6,
    ),
    loads=st.dictionaries(st.integers(1, 40), st.booleans(), max_size=2),
    aborts=st.dictionaries(st.integers(0, 40), st.lists(st.integers(0, 5), max_size=2), max_size=2),
)
def test_multi_turn_scheduler_never_hands_parked_kv_to_another_sequence(
    num_blocks, block_size, max_running, budget, sharing, trajs, loads, aborts
):
    drive_turns(num_blocks, block_size, max_running, budget, sharing, trajs, loads, aborts)


def test_multi_turn_scheduler_reclaims_idle_kv_under_pressure():
    sch = drive_turns(8, 2, 4, 8, True, [(6, 3, 3, 2, 3)] * 5, {}, {})
    assert sch.num_reclaimed > 0
