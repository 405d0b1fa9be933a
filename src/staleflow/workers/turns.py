"""The rollout worker's turn driver: multi-turn, tool-using trajectories (--env.name, docs/multi-turn.md).

One trajectory, several turns, one token payload (TrajectoryTokens: model tokens with their
behaviour log-probs and versions, environment tokens with loss_mask 0):

    route      a new trajectory: env.reset(prompt) starts in the env thread; the engine generates
               turn 1 with Request.hold=True (its KV is kept when the turn stops)
    turn ends  the engine returns the payload; unless max_turns / max_total_tokens end it, the turn's
               text goes to env.step in the env thread, under --env.step-timeout-s (run_step)
    step done  done: release the held KV, the trajectory is finished (Finished, env reward if any);
               else the observation's tokens (observation_tokens, through the chat template) are
               appended with engine.extend and the next turn generates
    pull       a trajectory parked on its tool call (the snapshot's parked_ids: tool_waiting_ids and
               the engine's parked ones) is not interrupted by the coordinator's pre-pull Interrupt nor
               by the rank's pull: its env step goes on; the weight load frees its held KV (unless
               keep-KV), and when the observation arrives engine.extend prefills the whole prefix
               plus the observation under the new weights and the next turn decodes, on the same
               instance: the call runs once and every later token comes from the new weights
    interrupt  inside a turn, or while the tool runs when the coordinator still sends one (migration
               never does; an abort, a straggler's truncation, a snapshot that had not yet seen the
               turn end): the engine's payload (aborted, or the parked one) is the partial record,
               exactly like a single-turn partial rollout; a pending env step is cancelled
    resume     on any instance, from the partial payload: a fresh environment is reset and the
               model's completed turns are replayed into it (their observations are already in the
               payload and are not re-appended); an unanswered tool call (the payload ends with a
               finished model turn) is stepped again, then the payload plus its observation is
               re-prefilled; a turn cut mid-way continues where it stopped.

The staleness protocol is untouched: the turns live inside one trajectory, V_traj is the version of
its first generated token (the loop fixes it at routing) and the bound holds for all its turns.
Replay requires an environment whose state is a function of the prompt row and the model's messages
so far (the ToolEnv built-ins keep none; a fork's env must be deterministic in them).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from staleflow import env as env_pkg
from staleflow.rollout.engine import Request, SamplingParams
from staleflow.trajectory import Prompt, TrajectoryTokens, TurnStats


def model_turns(tokens: TrajectoryTokens) -> list[list[int]]:
    """The model's turns in a payload: each maximal run of model tokens (loss_mask 1), in order.

    >>> model_turns(TrajectoryTokens([1], [5, 6, 9, 9, 7], [0.0] * 5, [0, 0, -1, -1, 1], [1, 1, 0, 0, 1]))
    [[5, 6], [7]]
    """
    turns, cur = [], None
    ids = tokens.response_ids.tolist() if hasattr(tokens.response_ids, "tolist") else tokens.response_ids
    for tok, m in zip(ids, tokens.mask_values()):
        if m:
            if cur is None:
                cur = []
                turns.append(cur)
            cur.append(int(tok))
        else:
            cur = None
    return turns


def ends_with_observation(tokens: TrajectoryTokens) -> bool:
    """Whether the payload's last token is the environment's (the next turn has not started)."""
    mask = tokens.mask_values()
    return bool(mask) and mask[-1] == 0


def final_turn_ids(tokens: TrajectoryTokens) -> list[int]:
    """The token ids of the model's last turn (what a task's reward fn scores in a multi-turn
    trajectory); every response token for a single-turn one."""
    if tokens.loss_mask is None:
        ids = tokens.response_ids
        return ids.tolist() if hasattr(ids, "tolist") else [int(t) for t in ids]
    turns = model_turns(tokens)
    return turns[-1] if turns else []


@dataclass
class Episode:
    """One multi-turn trajectory on this instance: its environment and where it stands. It references
    the trajectory's newest engine Request (the one added, then the one each turn returns) and holds
    no trajectory data of its own (docs/architecture.md counts the classes that do)."""

    request_id: int
    prompt: Prompt
    request: Request
    """The newest request: its payload and sampling parameters (the engine's copy after each turn)."""
    env: object
    ready: Future
    """env.reset plus the replay of earlier turns (a resumed trajectory)."""
    stats: TurnStats = field(default_factory=TurnStats)
    pending: Future | None = None
    """The env step running now (None: the engine has the trajectory, or it is being added)."""
    cut: bool = False
    """The last turn stopped at its token cap, not at a stop token (its end-of-turn tokens are missing)."""
    in_engine: bool = False

    @property
    def tokens(self) -> TrajectoryTokens:
        """The newest payload."""
        return self.request.tokens


class EnvThread:
    """An asyncio loop in a daemon thread: environment coroutines run off the engine's thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="staleflow-env", daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class TemplateCodec:
    """Text <-> tokens of turns through the model's tokenizer and chat template (staleflow.env)."""

    def __init__(self, tokenizer, tool_format: str):
        self.tokenizer = tokenizer
        self.tool_format = env_pkg.resolve_tool_format(tokenizer, tool_format)
        self.eot = env_pkg.end_of_turn_ids(tokenizer)
        """The template's end-of-turn tokens (closing a turn cut at its token cap)."""
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = set(self.eot) | ({int(eos)} if eos is not None else set())
        """Tokens that end a model turn."""

    def decode(self, ids: list[int]) -> str:
        """A turn as the environment reads it: special tokens kept (``<|python_tag|>`` is one; the
        tool-call parser drops a trailing stop token itself, docs/multi-turn.md)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def observation(self, text: str, max_tokens: int) -> list[int]:
        """The tool turn holding ``text`` and the next assistant header, at most ``max_tokens``."""
        return env_pkg.observation_tokens(self.tokenizer, self.tool_format, text, max_tokens)


class TurnDriver:
    """Drives the turns of every multi-turn trajectory on one engine. ``emit(request_id, tokens,
    finish_reason, partial, stats)`` writes a trajectory's record (the worker's ring path);
    ``codec`` turns tokens into the env's text and its observations into tokens (TemplateCodec);
    ``make_env()`` builds one environment per trajectory (default: --env.name's)."""

    def __init__(self, engine, env_cfg, codec, max_new_tokens: int, max_model_len: int, emit, make_env=None):
        self.engine, self.cfg, self.codec, self.emit = engine, env_cfg, codec, emit
        self.make_env = make_env or (lambda: env_pkg.make_env(env_cfg))
        self.turn_cap = env_cfg.max_turn_tokens or max_new_tokens
        self.max_model_len = max_model_len
        self.eot, self.stop_ids = list(codec.eot), set(codec.stop_ids)
        self.episodes: dict[int, Episode] = {}
        self.env_thread = EnvThread()

    # ---- limits ------------------------------------------------------------------------------
    def total_cap(self, tokens: TrajectoryTokens) -> int:
        """Most response tokens (model + environment) this trajectory may hold."""
        room = self.max_model_len - len(tokens.prompt_ids) - 1
        return min(self.cfg.max_total_tokens, room) if self.cfg.max_total_tokens else room

    def turn_complete(self, turn: list[int]) -> bool:
        return bool(turn) and (turn[-1] in self.stop_ids or len(turn) >= self.turn_cap)

    def owns(self, request_id) -> bool:
        return request_id in self.episodes

    @property
    def waiting_ids(self) -> list:
        """Trajectories held here but not in the engine's queues (an env step or a replay running)."""
        return [rid for rid, ep in self.episodes.items() if not ep.in_engine or ep.pending is not None]

    @property
    def tool_waiting_ids(self) -> list:
        """Trajectories whose env step runs now (parked on a tool call, in the engine or outside it)."""
        return [rid for rid, ep in self.episodes.items() if ep.pending is not None]

    @property
    def busy(self) -> bool:
        return any(ep.pending is not None or not ep.in_engine for ep in self.episodes.values())

    # ---- start / resume ------------------------------------------------------------------------
    def start(self, request_id, prompt: Prompt, tokens: TrajectoryTokens, params: SamplingParams) -> None:
        """A new trajectory (empty response) or a resumed one (its partial payload)."""
        env = self.make_env()
        if hasattr(env, "tool_format") and hasattr(self.codec, "tool_format"):
            env.tool_format = self.codec.tool_format  # ToolEnv reads the syntax the template uses
        turns = model_turns(tokens)
        replay = turns if (not turns or ends_with_observation(tokens)) else turns[:-1]
        last_done = bool(turns) and not ends_with_observation(tokens) and self.turn_complete(turns[-1])
        texts = [self.decode(t) for t in replay]
        req = Request(request_id, tokens, params, hold=True)
        ep = Episode(request_id, prompt, req, env, self.env_thread.submit(self._setup(env, prompt, texts)))
        ep.stats.turns = len(turns)
        self.episodes[request_id] = ep
        if last_done:  # interrupted while its tool ran (or before it started): step it again
            ep.cut = turns[-1][-1] not in self.stop_ids
            self._step(ep)
        else:
            self._add(ep)

    async def _setup(self, env, prompt: Prompt, texts: list[str]) -> tuple[int, float]:
        """reset, then replay the model's earlier turns (observations already in the payload):
        (tool calls, seconds) of the replay."""
        await env.reset(prompt)
        calls, secs = 0, 0.0
        for text in texts:
            step = await env_pkg.run_step(env, text, self.cfg.step_timeout_s)
            calls, secs = calls + step.tool_calls, secs + step.tool_s
        return calls, secs

    def _add(self, ep: Episode) -> None:
        """Hand the trajectory to the engine for its current turn (held when the turn stops)."""
        turns = model_turns(ep.tokens)
        done_in_turn = 0 if (not turns or ends_with_observation(ep.tokens)) else len(turns[-1])
        if not turns or ends_with_observation(ep.tokens):
            ep.stats.turns += 1  # a new turn starts
        n = len(ep.tokens.response_ids)
        budget = min(self.turn_cap - done_in_turn, self.total_cap(ep.tokens) - n)
        if budget < 1:
            self._finish(ep, "length")
            return
        params = SamplingParams(**{**_fields(ep.request.params), "max_new_tokens": n + budget})
        ep.request = Request(ep.request_id, ep.tokens, params, hold=True)
        self.engine.add(ep.request)
        ep.in_engine = True

    # ---- turns ---------------------------------------------------------------------------------
    def on_turn(self, out: Request) -> None:
        """The engine returned a trajectory's turn (it is parked there, KV held)."""
        ep = self.episodes[out.request_id]
        ep.request = out
        turn = model_turns(out.tokens)[-1]
        ep.cut = not turn or turn[-1] not in self.stop_ids
        n = len(out.tokens.response_ids)
        if ep.stats.turns >= self.cfg.max_turns or n >= self.total_cap(out.tokens):
            self._finish(ep, out.finish_reason)
            return
        self._step(ep)

    def _step(self, ep: Episode) -> None:
        text = self.decode(model_turns(ep.tokens)[-1])
        ep.pending = self.env_thread.submit(self._run_step(ep, text))

    async def _run_step(self, ep: Episode, text: str):
        try:
            calls, secs = await asyncio.wrap_future(ep.ready)
        except Exception as e:  # reset (or a replay) failed: the model reads it; max_turns bounds the rest
            ep.ready = _done_future((0, 0.0))
            return env_pkg.env_failure(ep.env, f"reset failed: {type(e).__name__}: {e}")
        ep.stats.tool_calls += calls
        ep.stats.tool_s += secs
        ep.ready = _done_future((0, 0.0))  # replayed once
        return await env_pkg.run_step(ep.env, text, self.cfg.step_timeout_s)

    def poll(self) -> None:
        """Act on the env steps that finished: extend the held trajectory, or finish it."""
        for ep in [e for e in self.episodes.values() if e.pending is not None and e.pending.done()]:
            fut, ep.pending = ep.pending, None
            try:
                step = fut.result()  # run_step never raises for a message or an environment's failure
            except Exception as e:  # defence in depth: nothing a model writes ends the rank
                step = env_pkg.env_failure(ep.env, f"{type(e).__name__}: {e}")
            ep.stats.tool_calls += step.tool_calls
            ep.stats.tool_s += step.tool_s
            if step.done:
                ep.stats.env_reward = step.reward
                self._finish(ep, "stop")
                continue
            self._observe(ep, step.observation)

    def _observe(self, ep: Episode, observation: str) -> None:
        head = list(self.eot) if ep.cut else []
        room = self.total_cap(ep.tokens) - len(ep.tokens.response_ids) - len(head) - 1  # >= 1 token of a next turn
        limit = min(self.cfg.max_observation_tokens, room)
        try:
            obs = head + self.codec.observation(observation, limit) if limit > 0 else None
        except Exception:  # the tool turn does not fit in what is left, or the template failed on the text
            obs = None
        if obs is None:  # no room for an observation and a next turn: the trajectory ends here
            self._finish(ep, "length")
            return
        n = len(ep.tokens.response_ids) + len(obs)
        if ep.in_engine:
            ep.stats.turns += 1
            self.engine.extend(ep.request_id, obs, min(self.turn_cap, self.total_cap(ep.tokens) - n))
            return
        ep.request = ep.request.copy()  # resumed with an unanswered call: the payload + observation, re-prefilled
        ep.request.tokens.append_observation(obs)
        self._add(ep)  # counts the new turn

    def _finish(self, ep: Episode, reason: str) -> None:
        del self.episodes[ep.request_id]
        if ep.in_engine:
            self.engine.release(ep.request_id)
        self.emit(ep.request_id, ep.tokens, reason, False, ep.stats)

    # ---- interrupt -------------------------------------------------------------------------------
    def forget(self, request_id) -> Episode | None:
        """Stop driving a trajectory (interrupted or aborted): its pending env step is cancelled. The
        caller has taken its payload from the engine (abort) or takes ``episode.tokens``."""
        ep = self.episodes.pop(request_id, None)
        if ep is not None and ep.pending is not None:
            ep.pending.cancel()
        return ep

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)

    def close(self) -> None:
        for rid in list(self.episodes):
            self.forget(rid)
        self.env_thread.close()


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}


def _done_future(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def prompt_row(request_id, prompt_ids, text: str = "", answer: str = "", meta: dict | None = None) -> Prompt:
    """The Prompt an environment is reset with, from what a Route carries."""
    return Prompt(int(request_id), text, answer, list(prompt_ids), dict(meta or {}))
