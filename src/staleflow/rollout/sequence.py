"""Sequence: the engine-side state of one request (its token payload, KV progress, block table).

A sequence holds its trajectory's payload (`tokens`, a TrajectoryTokens with list fields: the
prompt, then every response token with its log-prob and version), the same object its output
returns. `num_computed` counts the leading tokens (prompt then response) whose K/V are in the
paged cache; the scheduler feeds the tokens after it (a prefill chunk, or the single last token
when decoding). When num_computed reaches len(seq) the step's logits at the last position are
sampled and the new token is appended.

A held sequence (``Request.hold``, a multi-turn trajectory) is PARKED when its turn stops: out of
the scheduler's queues, its blocks kept. The turn's last sampled token has no K/V yet, so
``num_computed`` is len(seq) - 1; ``extend`` appends the observation and the next feed is that
token plus the observation (a prefill chunk after the cached history).
"""

from __future__ import annotations

import enum

from staleflow.rollout.engine import FinishReason, Request, RequestOutput, SamplingParams
from staleflow.tokens import TrajectoryTokens


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    """A held request between turns: not scheduled, blocks kept (see Request.hold)."""
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request_id",
        "params",
        "seed",
        "tokens",
        "num_prompt",
        "num_computed",
        "block_table",
        "status",
        "finish_reason",
        "arrival",
        "kv_epoch",
        "hold",
    )

    def __init__(self, request: Request, seed: int, arrival: int):
        self.request_id = request.request_id
        self.params: SamplingParams = request.params
        self.seed = seed
        self.tokens: TrajectoryTokens = request.tokens.copy()  # lists the engine extends
        self.num_prompt = len(self.tokens.prompt_ids)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival = arrival
        self.kv_epoch = 0
        self.hold = request.hold
        """Bumped each time the sequence's cached K/V is dropped (copies of it are then stale)."""

    def __len__(self) -> int:
        return self.num_prompt + len(self.tokens.response_ids)

    def token_at(self, pos: int) -> int:
        """The token at position ``pos`` of prompt + response."""
        n = self.num_prompt
        return self.tokens.prompt_ids[pos] if pos < n else self.tokens.response_ids[pos - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + response."""
        n, t = self.num_prompt, self.tokens
        if stop <= n:
            return t.prompt_ids[start:stop]
        if start >= n:
            return t.response_ids[start - n : stop - n]
        return t.prompt_ids[start:] + t.response_ids[: stop - n]

    @property
    def num_output(self) -> int:
        return len(self.tokens.response_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed before the next sample (1 when decoding)."""
        return len(self) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed > 1

    def append(self, token: int, logprob: float, version: int) -> None:
        self.tokens.append(token, logprob, version)

    def output(self) -> RequestOutput:
        assert self.finish_reason is not None
        return RequestOutput(self.request_id, self.tokens.copy(), self.finish_reason, self.seed)
