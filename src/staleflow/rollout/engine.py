"""The rollout-engine interface shared by the built-in engine and the (optional) vLLM engine.

A rollout rank drives one engine in a loop:

    engine.add(Request("traj-7", prompt_ids, SamplingParams(max_new_tokens=256, seed=7)))
    while True:
        for done in engine.step():         # finished Requests (tokens, log-probs, versions, finish_reason)
            send_to_trajectory_server(done)
        partial = engine.abort(["traj-3"])  # Interrupt: partial requests loop back to the TS
        engine.extend("traj-9", observation_ids, max_new_tokens=64)  # a held turn continues (hold=True)
        engine.release("traj-9")            # its trajectory ended: free the held KV
        engine.load_weights(named_tensors, version=5)   # Pull
        report(engine.stats())              # Snapshot for the coordinator

The engine's input and its output are one class, ``Request``: it carries the trajectory's token
payload (``TrajectoryTokens``, staleflow/trajectory.py: prompt, response, behaviour log-probs,
per-token weight versions, loss mask), the object the ring stores and the trainer reads; the
engine returns the finished request (its finish_reason and seed set). A resumed partial trajectory
is added again with the payload it was interrupted with; the engine re-prefills prompt + response
tokens and continues. Every field here is plain data (no torch).

Turns (multi-turn, tool-using trajectories): a request added with ``hold=True`` is returned
when its turn stops (eos / stop id / the turn's max_new_tokens) like any request, but the engine
keeps the sequence and its KV (*parked*: not scheduled). ``extend`` appends the environment's
observation (loss_mask 0) and schedules the next turn: the built-in engine prefills only the new
tokens; ``release`` frees it; ``abort`` of a parked request returns its payload. docs/engine.md,
"Turns: hold, extend, release".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from staleflow.tokens import TrajectoryTokens

FinishReason = Literal["stop", "length", "abort"]
"""stop: an eos / stop id was sampled (it is the last output token); length: max_new_tokens or
max model length reached; abort: interrupted by abort() (partial output)."""


class EngineError(ValueError):
    """Bad input to an engine (request, abort id, weights); the engine state is unchanged."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples.

    temperature 0 means greedy (argmax); its log-probs are then those of temperature 1.
    max_new_tokens counts ALL generated tokens of the trajectory, including the ones a resumed
    request already carries. seed None: the engine draws one at add() (kept in the returned
    Request's seed, so a resumed request given that seed continues the same random stream).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the model's eos ids always do, unless ignore_eos)."""
    ignore_eos: bool = False
    """Do not stop on eos ids (benchmarks); stop_ids still apply."""
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise EngineError(f"temperature={self.temperature!r} is invalid: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p={self.top_p!r} is invalid: must be in (0, 1]")
        if self.top_k < 0:
            raise EngineError(f"top_k={self.top_k!r} is invalid: must be >= 0 (0 disables)")
        if self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens={self.max_new_tokens!r} is invalid: must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class Request:
    """A trajectory to generate (a new prompt, or a partial trajectory resumed after an interrupt),
    and what the engine returns when it stops: the finished request.

    ``tokens`` is the payload (its response tokens, if any, are re-prefilled, not re-sampled); a
    plain list of token ids is taken as the prompt of a new trajectory. ``add`` never mutates the
    caller's request: the engine works on its own copy, and ``step`` / ``abort`` return a copy of
    that (its payload covers every response token, resumed ones included; behaviour log-probs are
    log_softmax(logits / temperature)[token] in fp32, untruncated by top-p/top-k; versions are the
    engine's weight version when each token was sampled), so a held request the engine keeps
    extending never aliases what it returned.

    >>> Request("r0", [1, 2, 3]).tokens.response_ids
    []
    >>> Request("r1", [1], SamplingParams(seed=7)).seed
    7
    """

    request_id: str | int
    tokens: TrajectoryTokens | list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    hold: bool = False
    """Multi-turn: when a turn stops, return the request but keep the sequence and its KV (parked)
    until ``extend`` (next turn), ``release`` or ``abort``."""
    seed: int | None = None
    """The seed the request samples with: None takes ``params.seed``; still None, the engine draws
    one at add. A returned request carries the seed used (resume with it: the same random stream)."""
    finish_reason: FinishReason | None = None
    """None while the request runs (the engine ignores it at add); set on a returned request."""

    def __post_init__(self):
        if not isinstance(self.tokens, TrajectoryTokens):
            self.tokens = TrajectoryTokens([int(t) for t in self.tokens])
        if self.seed is None:
            self.seed = self.params.seed

    def copy(self) -> Request:
        """The same request with a payload of its own (lists the engine may extend)."""
        return Request(self.request_id, self.tokens.copy(), self.params, self.hold, self.seed, self.finish_reason)


@dataclass(slots=True)
class CostSample:
    """One profiled engine step: the inputs and the output of the decode cost model."""

    n_running: int
    """Sequences that produced a token this step."""
    kv_tokens: int
    """KV-cache tokens attended this step (resident tokens of the running sequences)."""
    prefill_tokens: int
    """Prompt tokens processed this step (0 for a pure-decode step, the ones the fit uses)."""
    latency_s: float


@dataclass(slots=True)
class EngineStats:
    """Snapshot of an instance for the coordinator (Snapshot-Command cycle)."""

    num_running: int
    num_waiting: int
    kv_tokens: int
    """Tokens whose K/V are resident in the cache."""
    kv_capacity: int
    """Cache capacity in tokens (blocks * block size)."""
    tokens_generated: int
    """Tokens sampled since the engine started."""
    last_step_latency_s: float
    version: int
    running_ids: list
    waiting_ids: list
    steps: int = 0
    throughput_tok_s: float = 0.0
    """Tokens sampled per second, exponential moving average over recent steps (weight 0.2 per step)."""
    num_parked: int = 0
    """Held requests between turns (not scheduled; their K/V, if still resident, is in kv_tokens)."""
    parked_ids: list = field(default_factory=list)


class RolloutEngine(Protocol):
    """Everything a rollout rank (workers/rollout.py) and its weight source
    (servers/weights.py) use of an engine, built-in or vLLM."""

    version: int
    """Weight version loaded now (stamped on every token sampled afterwards)."""
    steps: int
    """Engine steps run so far (the rank's pulse reports it as progress)."""

    def add(self, request: Request) -> None: ...

    def step(self) -> list[Request]: ...

    def abort(self, request_ids: Iterable, missing_ok: bool = False) -> list[Request]: ...

    def stats(self) -> EngineStats: ...

    def extend(self, request_id, observation_ids: list[int], max_new_tokens: int) -> None:
        """Next turn of a parked (``hold=True``) request: append ``observation_ids`` as environment
        tokens (loss_mask 0, ENV_LOGPROB, ENV_VERSION) and generate up to ``max_new_tokens`` more."""

    def release(self, request_id) -> None:
        """Free a parked request (its trajectory ended); an EngineError if it is not parked here."""

    def has_unfinished(self) -> bool: ...

    def weight_targets(self) -> dict | None:
        """Tensors (HF names) a weight source may copy the next version into in place before
        ``load_weights`` stamps it, or None when the engine's weights live elsewhere (vLLM's
        worker process): the source then hands over tensors of its own."""

    def load_weights(self, named_tensors: Mapping | Iterable, version: int, keep_kv: bool = False) -> None:
        """Load (or, given its own ``weight_targets``, accept) ``version``. keep_kv: sequences in
        flight keep the KV computed with the old weights (only their next tokens use the new
        ones); else their KV is recomputed. Engines that cannot keep KV say so in their docs."""

    def close(self) -> None: ...


class SelfLoadingEngine(RolloutEngine, Protocol):
    """An engine whose own worker process maps the Parameter Server (vLLM)."""

    def load_from_server(self, run_id: str, reader: int, keep_kv: bool = False, timeout: float = 60.0) -> int: ...


def generate_all(engine: RolloutEngine, requests: Iterable[Request]) -> list[Request]:
    """Add all requests to `engine` and step it until they finish; the finished requests in request order."""
    order = []
    for r in requests:
        engine.add(r)
        order.append(r.request_id)
    pending, done = set(order), {}
    while pending:
        for out in engine.step():
            done[out.request_id] = out
            pending.discard(out.request_id)
    return [done[r] for r in order]


def abort_ids(request_ids: Iterable, live, missing_ok: bool) -> list:
    """The distinct ids to abort, in order, after checking them against `live` (a container of
    the engine's waiting + running ids). An unknown id is an EngineError before anything is
    aborted, unless missing_ok: then it is skipped (a rank loop racing with step(): the request
    just finished and was already returned)."""
    ids = list(dict.fromkeys(request_ids))
    unknown = [r for r in ids if r not in live]
    if unknown and not missing_ok:
        raise EngineError(
            f"abort: unknown request_id {unknown[0]!r} (not waiting or running here); nothing was aborted"
        )
    return [r for r in ids if r in live]


def check_extend(
    request_id, parked, seq_len: int, observation_ids, max_new_tokens: int, max_model_len: int, vocab_size: int
):
    """The observation as a list of ints, after checking an ``extend`` call (EngineError naming the
    request and the fix; nothing has changed). ``parked``: whether request_id is parked here (None:
    unknown)."""
    if parked is None:
        raise EngineError(f"extend: unknown request_id {request_id!r} (not held here): add it with hold=True first")
    if not parked:
        raise EngineError(
            f"extend: request {request_id!r} is still generating its turn: extend it after step() returned it"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise EngineError(
            f"extend: max_new_tokens={max_new_tokens!r} for request {request_id!r} is invalid: must be >= 1"
        )
    obs = [int(t) for t in observation_ids]
    bad = [t for t in obs if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(
            f"extend: request {request_id!r}: observation token id {bad[0]} outside the vocabulary [0, {vocab_size})"
        )
    if seq_len + len(obs) >= max_model_len:
        raise EngineError(
            f"extend: request {request_id!r}: {seq_len} tokens + an observation of {len(obs)} do not fit "
            f"max_model_len={max_model_len} (need room for one new token): end the trajectory (release) or "
            f"truncate the observation"
        )
    return obs


def check_request(request: Request, max_model_len: int, vocab_size: int) -> None:
    """Raise EngineError (naming the request and the fix) for a request no engine can run."""
    rid, t = request.request_id, request.tokens
    n_prompt, n_out = len(t.prompt_ids), len(t.response_ids)
    if n_prompt == 0:
        raise EngineError(f"request {rid!r} has an empty prompt: give at least one prompt token")
    if n_prompt + n_out >= max_model_len:
        raise EngineError(
            f"request {rid!r}: prompt of {n_prompt} tokens + {n_out} generated does not fit "
            f"max_model_len={max_model_len} (need room for one new token): shorten the "
            f"prompt or raise --rollout.max-model-len"
        )
    try:
        t.validate(f"request {rid!r}")
    except ValueError as e:
        raise EngineError(str(e)) from None
    if n_out >= request.params.max_new_tokens:
        raise EngineError(
            f"request {rid!r} already has {n_out} generated tokens >= max_new_tokens="
            f"{request.params.max_new_tokens}: it is finished, do not resume it"
        )
    bad = [x for x in list(t.prompt_ids) + list(t.response_ids) if not 0 <= int(x) < vocab_size]
    if bad:
        raise EngineError(f"request {rid!r} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
