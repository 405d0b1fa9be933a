"""Sequence: the built-in engine's KV and scheduling state of one request.

A sequence holds no trajectory data of its own: it references the engine's own ``Request`` (the
copy ``add`` made, whose payload ``tokens`` the engine extends: the prompt, then every response
token with its log-prob and version) and adds the engine's bookkeeping: `num_computed`, the
leading tokens (prompt then response) whose K/V are in the paged cache; the block table; the
scheduling status; the arrival order; the KV epoch. The scheduler feeds the tokens after
num_computed (a prefill chunk, or the single last token when decoding). When num_computed reaches
len(seq) the step's logits at the last position are sampled and the new token is appended to the
request's payload. The token accessors below read through the request.

A held sequence (``Request.hold``, a multi-turn trajectory) is PARKED when its turn stops: out of
the scheduler's queues, its blocks kept. The turn's last sampled token has no K/V yet, so
``num_computed`` is len(seq) - 1; ``extend`` appends the observation and the next feed is that
token plus the observation (a prefill chunk after the cached history).
"""

from __future__ import annotations

import enum

from staleflow.rollout.engine import Request, SamplingParams
from staleflow.tokens import TrajectoryTokens


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    """A held request between turns: not scheduled, blocks kept (see Request.hold)."""
    FINISHED = "finished"


class Sequence:
    __slots__ = ("request", "num_computed", "block_table", "status", "arrival", "kv_epoch", "draft")

    def __init__(self, request: Request, arrival: int):
        """``request``: the engine's own copy (its seed resolved), referenced, not copied."""
        self.request = request
        self.num_computed = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.arrival = arrival
        self.kv_epoch = 0
        """Bumped each time the sequence's cached K/V is dropped (copies of it are then stale)."""
        self.draft: list[int] = []
        """Speculative decoding: the draft tokens this step feeds after the last token (speculative.py);
        empty outside a step and for a plain decode. Never part of the payload until verified."""

    # ---- the request's data, read through ------------------------------------------------
    @property
    def request_id(self):
        return self.request.request_id

    @property
    def tokens(self) -> TrajectoryTokens:
        return self.request.tokens

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def seed(self) -> int:
        return self.request.seed

    @property
    def hold(self) -> bool:
        return self.request.hold

    @property
    def num_prompt(self) -> int:
        return len(self.request.tokens.prompt_ids)

    def __len__(self) -> int:
        t = self.request.tokens
        return len(t.prompt_ids) + len(t.response_ids)

    def token_at(self, pos: int) -> int:
        """The token at position ``pos`` of prompt + response."""
        t = self.request.tokens
        n = len(t.prompt_ids)
        return t.prompt_ids[pos] if pos < n else t.response_ids[pos - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + response."""
        t = self.request.tokens
        n = len(t.prompt_ids)
        if stop <= n:
            return t.prompt_ids[start:stop]
        if start >= n:
            return t.response_ids[start - n : stop - n]
        return t.prompt_ids[start:] + t.response_ids[: stop - n]

    @property
    def num_output(self) -> int:
        return len(self.request.tokens.response_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed before the next sample (1 when decoding)."""
        return len(self) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed > 1

    def append(self, token: int, logprob: float, version: int) -> None:
        self.request.tokens.append(token, logprob, version)
