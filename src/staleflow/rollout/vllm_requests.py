"""The vLLM engine's request table (rollout/vllm_engine.py): its own Requests and the side tables that follow
them, one class, so every change of a request's place (submitted, finished, parked between turns, extended,
aborted, released, dropped by a weight load) is made in one place; the engine talks to vLLM."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from staleflow.rollout.engine import EngineError, Request, abort_ids, check_extend


class VllmRequests:
    """The vLLM engine's request table: its own Requests by request id (live: running or waiting inside vLLM,
    in arrival order; parked: a held request between turns, Request.hold) and the side tables that follow
    them (the vLLM id of each live one's current submission, its prefix-cache hits). Every change of a
    request's place goes through here; the engine talks to vLLM."""

    def __init__(self):
        self.live: dict = {}  # request_id -> Request, running or waiting, in arrival order
        self.parked: dict = {}  # request_id -> Request of a held request between turns
        self.vid: dict = {}  # request_id -> its vLLM id (fresh at every submission)
        self.by_vid: dict = {}  # vLLM id -> request_id
        self.cached_tokens: dict = {}
        """request_id -> prefix-cache hits vLLM reported for its latest submission (num_cached_tokens)."""
        self._next_vid = 0

    def __contains__(self, request_id) -> bool:
        return request_id in self.live or request_id in self.parked

    @property
    def empty(self) -> bool:
        return not (self.live or self.parked or self.vid or self.by_vid or self.cached_tokens)

    def next_vid(self) -> str:
        """A fresh vLLM id (never reused: an aborted submission's late output must not match a new one)."""
        self._next_vid += 1
        return str(self._next_vid - 1)

    def submitted(self, req: Request, vid: str) -> None:
        """A (possibly resumed) request went to vLLM under ``vid``: it is live."""
        rid = req.request_id
        self.cached_tokens[rid] = 0
        self.vid[rid], self.by_vid[vid] = vid, rid
        self.live[rid] = req

    def output(self, vid: str, cached: int) -> Request | None:
        """The live request a vLLM output belongs to (None: aborted meanwhile); records its cache hits."""
        rid = self.by_vid.get(vid)
        if rid is None:
            return None
        self.cached_tokens[rid] = max(self.cached_tokens.get(rid, 0), cached)
        return self.live[rid]

    def finished(self, req: Request, park: bool) -> None:
        """vLLM finished the request's submission: parked (a turn ended, it waits for extend) or gone."""
        rid = req.request_id
        del self.by_vid[self.vid.pop(rid)], self.live[rid]
        if park:
            self.parked[rid] = req
        else:
            self.cached_tokens.pop(rid, None)

    def dropped_by_vllm(self) -> list[str]:
        """Every live request leaves vLLM (a weight load): their vLLM ids, forgotten; the requests stay live."""
        vids = [self.vid[r] for r in self.live]
        self.vid.clear()
        self.by_vid.clear()
        return vids

    def _forget(self, request_id) -> None:
        vid = self.vid.pop(request_id, None)
        if vid is not None:
            self.by_vid.pop(vid, None)
        self.cached_tokens.pop(request_id, None)

    def abort(self, request_ids: Iterable, missing_ok: bool, abort_in_vllm) -> list[Request]:
        """Interrupt requests (parked ones too); returns them, partial (finish_reason 'abort'), as copies.
        ``abort_in_vllm(vids)`` stops the running ones inside vLLM. Unknown ids: see ``abort_ids``."""
        ids = abort_ids(request_ids, self.live.keys() | self.parked.keys(), missing_ok)
        running = [r for r in ids if r not in self.parked]
        if running:
            abort_in_vllm([self.vid[r] for r in running])
        out = []
        for r in ids:
            req = self.parked.pop(r) if r in self.parked else self.live.pop(r)
            self._forget(r)
            req.finish_reason = "abort"
            out.append(req.copy())
        return out

    def extend(self, request_id, observation_ids: list[int], max_new_tokens: int, max_len: int, vocab: int) -> Request:
        """Next turn of a parked request: the observation is appended (environment tokens) and the request
        returned for resubmission (prompt + history + observation; vLLM's prefix cache skips the cached full
        blocks of the history). SamplingParams.max_new_tokens becomes the response length after the
        observation plus ``max_new_tokens``. EngineError before anything changes."""
        req = self.parked.get(request_id)
        running = self.live.get(request_id)
        parked = True if req is not None else (False if running is not None and running.hold else None)
        n = len(req.tokens.prompt_ids) + len(req.tokens.response_ids) if req is not None else 0
        obs = check_extend(request_id, parked, n, observation_ids, max_new_tokens, max_len, vocab)
        del self.parked[request_id]
        req.tokens.append_observation(obs)
        req.params = dataclasses.replace(req.params, max_new_tokens=len(req.tokens.response_ids) + max_new_tokens)
        req.finish_reason = None
        return req

    def release(self, request_id, missing_ok: bool = False) -> None:
        """Forget a parked request (vLLM holds nothing of it but evictable prefix-cache blocks)."""
        if self.parked.pop(request_id, None) is not None:
            self._forget(request_id)
            return
        if missing_ok and request_id not in self.live:
            return
        where = "unknown here" if request_id not in self.live else "running, not parked: abort it instead"
        raise EngineError(f"release: request {request_id!r} is {where}")
