"""A rollout engine: static ("lockstep") batching over the built-in engine.

The built-in engine batches continuously: a request that arrives while others decode joins the
next step. Static batching, as Hugging Face's ``generate`` and early RL systems run, admits a new
batch only when the whole running batch has finished, so a batch lasts as long as its longest
response. The question this fork answers: how much does that cost the run, in rollout throughput
and in staleness? It only decides WHEN requests enter the built-in engine; the engine itself
samples every token with its log-prob and stamps it with the weight version it was sampled with,
so the trainer's off-policy correction and the staleness protocol see nothing new.

    PYTHONPATH=$PWD ./launch.sh --preset tiny --rollout.engine examples.lockstep_engine:LockstepBackend

Everything an engine brings to a run is its backend (staleflow.engines.EngineBackend): this one
builds the wrapped engine, and inherits the rest from the built-in backend: the rank loads the
policy and hands it over, pulls copy straight into the engine's parameters, every layout runs,
and the memory plan counts the built-in engine's rows (static batching allocates nothing more).
"""

from __future__ import annotations

import dataclasses

from examples.calls import record
from staleflow.engines.builtin import BuiltinBackend
from staleflow.rollout.engine import EngineError, check_request


class LockstepEngine:
    """Holds the requests it is given until the wrapped engine has nothing unfinished, then admits
    up to ``batch`` of them at once (oldest first). The RolloutEngine interface
    (staleflow.rollout.engine) is the wrapped engine's, with the held requests counted as waiting."""

    def __init__(self, inner, batch: int):
        self.inner, self.batch = inner, batch
        self.held: list = []  # Requests not yet admitted, in arrival order

    def add(self, request) -> None:
        """Checked now, as the wrapped engine checks it (an EngineError reaches the caller of add)."""
        rid = request.request_id
        if any(r.request_id == rid for r in self.held) or rid in self.inner.seqs:
            raise EngineError(f"request_id={rid!r} is already in the engine: use a fresh id or abort it first")
        check_request(request, self.inner.max_model_len, self.inner.vocab_size)
        self.held.append(request)

    def step(self) -> list:
        if not self.inner.has_unfinished() and self.held:
            admitted, self.held = self.held[: self.batch], self.held[self.batch :]
            for request in admitted:
                self.inner.add(request)
            record("LockstepEngine.admit")
        return self.inner.step()

    def abort(self, request_ids, missing_ok: bool = False) -> list:
        """A held request is admitted and aborted at once: the wrapped engine returns it as it
        would any request it holds (its tokens so far, log-probs and versions)."""
        ids = set(request_ids)
        for request in [r for r in self.held if r.request_id in ids]:
            self.inner.add(request)
        self.held = [r for r in self.held if r.request_id not in ids]
        return self.inner.abort(request_ids, missing_ok=missing_ok)

    def stats(self):
        s = self.inner.stats()
        return dataclasses.replace(
            s, num_waiting=s.num_waiting + len(self.held), waiting_ids=s.waiting_ids + [r.request_id for r in self.held]
        )

    def has_unfinished(self) -> bool:
        return bool(self.held) or self.inner.has_unfinished()

    def weight_targets(self):
        return self.inner.weight_targets()

    def load_weights(self, named_tensors, version: int, keep_kv: bool = False) -> None:
        self.inner.load_weights(named_tensors, version, keep_kv=keep_kv)

    def close(self) -> None:
        self.inner.close()

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def steps(self) -> int:
        return self.inner.steps


class LockstepBackend(BuiltinBackend):
    """--rollout.engine examples.lockstep_engine:LockstepBackend: batches of --rollout.max-running."""

    def build(self, ctx, model, gpu_share):
        record("LockstepBackend.build")
        return LockstepEngine(super().build(ctx, model, gpu_share), batch=ctx.cfg.rollout.max_running)
