"""Sequence: the engine-side state of one request (tokens, KV progress, block table).

A sequence holds prompt + generated tokens in `token_ids`. `num_computed` counts the leading
tokens whose K/V are in the paged cache; the scheduler feeds the tokens after it (a prefill
chunk, or the single last token when decoding). When num_computed reaches len(token_ids) the
step's logits at the last position are sampled and the new token is appended.
"""

from __future__ import annotations

import enum

from staleflow.rollout.engine import FinishReason, Request, RequestOutput, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request_id",
        "params",
        "seed",
        "token_ids",
        "num_prompt",
        "logprobs",
        "versions",
        "num_computed",
        "block_table",
        "status",
        "finish_reason",
        "arrival",
        "kv_epoch",
    )

    def __init__(self, request: Request, seed: int, arrival: int):
        self.request_id = request.request_id
        self.params: SamplingParams = request.params
        self.seed = seed
        self.num_prompt = len(request.prompt_ids)
        self.token_ids: list[int] = list(request.prompt_ids) + list(request.output_ids)
        self.logprobs: list[float] = [float(x) for x in request.output_logprobs]
        self.versions: list[int] = [int(x) for x in request.output_versions]
        self.num_computed = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival = arrival
        self.kv_epoch = 0
        """Bumped each time the sequence's cached K/V is dropped (copies of it are then stale)."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed before the next sample (1 when decoding)."""
        return len(self.token_ids) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed > 1

    def append(self, token: int, logprob: float, version: int) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)

    def output(self) -> RequestOutput:
        assert self.finish_reason is not None
        return RequestOutput(
            request_id=self.request_id,
            prompt_ids=self.token_ids[: self.num_prompt],
            output_ids=self.token_ids[self.num_prompt :],
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason,
            seed=self.seed,
        )
