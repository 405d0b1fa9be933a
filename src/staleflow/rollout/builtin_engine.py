"""BuiltinEngine: the default rollout engine (pure PyTorch, CPU and CUDA).

    engine = BuiltinEngine.from_config(run_cfg.model, run_cfg.rollout)     # or BuiltinEngine(model)
    engine.add(Request("r0", prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=64, seed=0)))
    while engine.has_unfinished():
        finished = engine.step()

One step = Scheduler.schedule() (continuous batching, chunked prefill, preemption by
recompute, prompt blocks shared within a GRPO group when prefix_sharing) -> ModelRunner.run()
(one packed forward over the paged KV cache; decode attention by the backend resolved once in
decode_backend.py: DecodeMirror rows on CPU, a paged kernel on CUDA) -> Sampler (fp32 logits) ->
append tokens, finish on eos / stop ids / max_new_tokens / max_model_len, free the KV blocks of
finished sequences. Every sampled token is stamped with the engine's weight version.
load_weights() copies new tensors into the parameters in place (after validating all of them);
in-flight sequences keep their tokens and re-prefill under the new weights, or with keep_kv keep
their K/V and continue at once (each token keeps the log-prob and version that sampled it).
Turns: a ``hold=True`` request is parked (KV kept) when its turn stops; extend() appends the
observation and prefills only it, release() frees it (docs/engine.md, "Turns").
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from staleflow.rollout.block_manager import BlockManager
from staleflow.rollout.engine import (
    CostSample,
    EngineError,
    EngineStats,
    Request,
    abort_ids,
    check_extend,
    check_request,
    generate_all,
)
from staleflow.rollout.model_runner import ModelRunner
from staleflow.rollout.prefix_sharing import SharingBlockManager
from staleflow.rollout.sampler import Sampler
from staleflow.rollout.scheduler import Scheduler
from staleflow.rollout.sequence import Sequence, SequenceStatus
from staleflow.rollout.speculative import make_speculator
from staleflow.rollout.weight_check import check_weights

if TYPE_CHECKING:
    from staleflow.config.speculative import SpeculativeConfig
    from staleflow.model import CausalLM


class BuiltinEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_running: int = 64,
        max_kv_tokens: int = 65536,
        block_size: int = 16,
        prefill_chunk_tokens: int = 2048,
        max_model_len: int = 2048,
        eos_ids: Iterable[int] | None = None,
        version: int = 0,
        seed: int = 0,
        profile: bool = False,
        decode_mirror: bool | None = None,
        decode_backend: str = "auto",
        prefix_sharing: bool = True,
        cuda_graphs: bool = False,
        speculative: SpeculativeConfig | None = None,
    ):
        """decode_backend: "auto" | "mirror" | "gather" | "triton" | "flash" (decode_backend.py);
        decode_mirror True / False is the older spelling of "mirror" / "gather". prefix_sharing:
        requests with the same prompt share its full KV blocks (prefix_sharing.py). cuda_graphs: replay
        captured decode steps (cuda_graphs.py; CUDA with the triton / flash backend only). speculative:
        drafts from the group's tokens, verified exactly (speculative.py; off unless draft_tokens > 0)."""
        num_blocks = max_kv_tokens // block_size
        if num_blocks * block_size < max_model_len:
            raise EngineError(
                f"max_kv_tokens={max_kv_tokens} cannot hold one sequence of max_model_len="
                f"{max_model_len}: raise --rollout.max-kv-tokens or lower --rollout.max-model-len"
            )
        if max_running < 1 or prefill_chunk_tokens < 1:
            raise EngineError(f"max_running={max_running} and prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1")
        model.eval()
        model.requires_grad_(False)
        if hasattr(model, "fuse_projections"):
            model.fuse_projections()  # one GEMM for q|k|v and gate|up; every parameter contiguous
        self.model = model
        self.vocab_size = int(model.args.vocab_size)
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(model.args.eos_token_ids if eos_ids is None else eos_ids)
        self.version = int(version)
        self.block_manager = (SharingBlockManager if prefix_sharing else BlockManager)(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_running, prefill_chunk_tokens)
        self.speculator = make_speculator(  # before the runner: its one-line refusal comes first
            speculative, cuda_graphs, self.block_manager, max_model_len, self.scheduler.watermark
        )
        self.runner = ModelRunner(
            model,
            self.block_manager,
            max_running=max_running,
            max_model_len=max_model_len,
            decode_mirror=decode_mirror,
            decode_backend=decode_backend,
            cuda_graphs=cuda_graphs,
        )
        self.sampler = Sampler()
        self.seqs: dict = {}
        self._rng = random.Random(seed)
        self._arrivals = 0
        self.tokens_generated = 0
        self.steps = 0
        self.last_step_latency_s = 0.0
        self.throughput_tok_s = 0.0
        self.profile = profile
        self.profile_samples: list[CostSample] = []

    @classmethod
    def from_config(
        cls,
        model_cfg,
        rollout_cfg,
        device: str | torch.device | None = None,
        version: int = 0,
        profile: bool | None = None,
        model: CausalLM | None = None,
        seed: int = 0,
    ) -> BuiltinEngine:
        """The one way to build an engine from ModelConfig + RolloutConfig (staleflow.config).

        `model`: an already loaded CausalLM (a rollout rank's, see load_rollout_model), cast here to
        the rollout dtype if it is in another one; None loads --model.path onto `device`."""
        if model is not None:
            device = next(model.parameters()).device
            dtype = rollout_dtype(model_cfg, rollout_cfg, device)
            if next(model.parameters()).dtype != dtype:
                model = model.to(dtype)
        else:
            device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            model = load_rollout_model(model_cfg, rollout_cfg, device)
        rc = rollout_cfg
        return cls(
            model,
            max_running=rc.max_running,
            max_kv_tokens=rc.max_kv_tokens,
            block_size=rc.block_size,
            prefill_chunk_tokens=rc.prefill_chunk_tokens,
            max_model_len=rc.max_model_len,
            version=version,
            seed=seed,
            profile=rc.profile if profile is None else profile,
            decode_backend=rc.decode_backend,
            prefix_sharing=rc.prefix_sharing,
            cuda_graphs=rc.cuda_graphs,
            speculative=rc.speculative,
        )

    # ---- requests ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.seqs:
            raise EngineError(f"request_id={rid!r} is already in the engine: use a fresh id or abort it first")
        check_request(request, self.max_model_len, self.vocab_size)
        own = request.copy()  # the engine's own request: the caller's is never mutated
        own.seed = int(self._rng.getrandbits(63) if own.seed is None else own.seed)
        own.finish_reason = None
        seq = Sequence(own, arrival=self._arrivals)
        self._arrivals += 1
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        if self.speculator is not None:
            self.speculator.join(rid, own.tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_ids: Iterable, missing_ok: bool = False) -> list[Request]:
        """Interrupt requests; returns them, partial (finish_reason 'abort').

        Unknown ids: see `abort_ids` (an error unless missing_ok).
        """
        outs = []
        for rid in abort_ids(request_ids, self.seqs, missing_ok):
            seq = self.seqs.pop(rid)
            self.scheduler.remove(seq)
            self._forget(rid)
            seq.request.finish_reason = "abort"
            outs.append(seq.request.copy())
        return outs

    def abort_all(self) -> list[Request]:
        return self.abort(list(self.seqs))

    # ---- turns (hold / extend / release) -------------------------------------------------
    def extend(self, request_id, observation_ids: list[int], max_new_tokens: int) -> None:
        """Next turn of a parked request: append the observation (environment tokens: loss_mask 0,
        ENV_LOGPROB, ENV_VERSION) and schedule it first in the waiting queue. Only the turn's last
        sampled token and the observation are prefilled, after the cached history (all of it if
        its K/V was freed meanwhile: a weight load without keep_kv, or reclaimed for others). The
        turn generates up to ``max_new_tokens`` tokens: SamplingParams.max_new_tokens becomes the
        response length after the observation plus that. EngineError before anything changes."""
        seq = self.seqs.get(request_id)
        parked = None if seq is None or not seq.hold else seq.status is SequenceStatus.PARKED
        obs = check_extend(
            request_id,
            parked,
            len(seq) if seq else 0,
            observation_ids,
            max_new_tokens,
            self.max_model_len,
            self.vocab_size,
        )
        req = seq.request
        req.tokens.append_observation(obs)
        req.params = dataclasses.replace(req.params, max_new_tokens=seq.num_output + max_new_tokens)
        req.finish_reason = None
        self.scheduler.resume(seq)

    def release(self, request_id, missing_ok: bool = False) -> None:
        """Free a parked request's KV and forget it (its trajectory ended). An EngineError for an id
        that is not parked here (a running one: abort it), unless missing_ok and it is unknown."""
        seq = self.seqs.get(request_id)
        if seq is None and missing_ok:
            return
        if seq is None or seq.status is not SequenceStatus.PARKED:
            where = "unknown here" if seq is None else f"{seq.status.value}, not parked: abort it instead"
            raise EngineError(f"release: request {request_id!r} is {where}")
        self.scheduler.remove(seq)
        del self.seqs[request_id]
        self._forget(request_id)

    def _forget(self, request_id) -> None:
        """A request left the engine (its text may still draft for its group's others)."""
        if self.speculator is not None:
            self.speculator.leave(request_id)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Advance every running request by one token (prefill chunks as the budget allows; with
        speculative decoding a decode may emit several); returns the requests that stopped in this
        step (copies: a held one keeps running here)."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        spec = self.speculator
        drafts = 0
        if spec is not None:
            spec.plan(batch)
            drafts = sum(len(s.draft) for s in batch.seqs[: batch.num_decode])
        logits, rows = self.runner.run(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
        kv_attended = sum(s.num_computed for s in batch.seqs)
        finished: list[Request] = []
        emitted = 0
        if rows:
            seqs = [batch.seqs[i] for i in rows]
            # batch index -> its first row (a decode with a draft has one row per fed token)
            first = {i: r for r, i in reversed(list(enumerate(rows)))}
            positions = [s.num_output + r - first[i] for r, (s, i) in enumerate(zip(seqs, rows))]
            tokens, logprobs = self.sampler(logits, [s.params for s in seqs], [s.seed for s in seqs], positions)
            for i, r in first.items():
                seq = batch.seqs[i]
                toks, lps = tokens[r : r + 1 + len(seq.draft)], logprobs[r : r + 1 + len(seq.draft)]
                verify = spec is not None and i < batch.num_decode
                if verify:  # exact rejection sampling of the draft
                    toks, lps = spec.accept(seq, toks, lps)
                n, done = self._emit(seq, toks, lps)
                emitted += n
                finished.extend(done)
                if verify:
                    spec.emitted(n, batch.num_decode)
            self.tokens_generated += emitted
        if spec is not None:
            spec.rollback(batch.seqs[: batch.num_decode], self.runner.mirror)
        self.steps += 1
        self.last_step_latency_s = time.perf_counter() - t0
        rate = emitted / max(self.last_step_latency_s, 1e-9)
        self.throughput_tok_s = rate if self.steps == 1 else 0.8 * self.throughput_tok_s + 0.2 * rate
        if self.profile and not drafts:  # the decode cost model is of one token a sequence: a draft row is not one
            self.profile_samples.append(
                CostSample(
                    n_running=len(batch),
                    kv_tokens=kv_attended,
                    prefill_tokens=batch.prefill_tokens,
                    latency_s=self.last_step_latency_s,
                )
            )
        return finished

    def _emit(self, seq: Sequence, toks: list[int], lps: list[float]) -> tuple[int, list[Request]]:
        """Append a row's tokens until one stops the sequence: (tokens appended, [its request's copy] if it stopped)."""
        for n, (tok, lp) in enumerate(zip(toks, lps), 1):
            seq.append(tok, lp, self.version)
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                seq.request.finish_reason = reason
                if seq.hold:  # a turn of a multi-turn request: keep its KV until extend / release
                    self.scheduler.park(seq)
                else:
                    self.scheduler.remove(seq)
                    del self.seqs[seq.request_id]
                    self._forget(seq.request_id)
                return n, [seq.request.copy()]
        return len(toks), []

    def _finish_reason(self, seq: Sequence, tok: int):
        p = seq.params
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_ids:
            return "stop"
        if seq.num_output >= p.max_new_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def generate(self, requests: Iterable[Request]) -> list[Request]:
        """Add all requests, step until they finish; the finished requests in request order (tests, benchmarks)."""
        return generate_all(self, requests)

    # ---- weights -------------------------------------------------------------------------
    def weight_targets(self) -> dict[str, torch.Tensor]:
        """The parameters themselves (HF names): a weight source copies a version straight into
        them, cast on their device, and ``load_weights`` of the same tensors only stamps it."""
        return dict(self.model.named_parameters())

    def close(self) -> None:
        """Nothing outside this process to stop (the KV cache goes with the engine)."""

    def load_weights(
        self, named_tensors: Mapping | Iterable, version: int, strict: bool = True, keep_kv: bool = False
    ) -> None:
        """Copy named tensors (HF names) into the parameters in place and set the weight version.

        Everything is validated first (names, shapes, floating dtype, every parameter covered when
        strict, version not older than the current one); on any error nothing is touched.
        In-flight requests keep their tokens; their KV is dropped and recomputed with the new
        weights, unless keep_kv (--coordinator.keep-kv-on-pull, or drain mode): then the KV computed
        with the old weights stays and only the next tokens come from the new ones.
        """
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        check_weights(items, params, version, self.version, strict)
        with torch.no_grad():
            for name, t in items:
                params[name].copy_(t)
        self.version = version
        if not keep_kv:
            self.scheduler.evict_all_kv()
        elif isinstance(self.block_manager, SharingBlockManager):
            self.block_manager.retire_prefixes()  # only in-flight holders keep reading old-weight K/V

    # ---- stats ---------------------------------------------------------------------------
    def kv_tokens(self) -> int:
        """Tokens whose K/V is resident: running sequences' and idle held ones' (parked, or
        extended and not yet admitted)."""
        return sum(s.num_computed for s in self.seqs.values())

    def stats(self) -> EngineStats:
        sch = self.scheduler
        return EngineStats(
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            kv_tokens=self.kv_tokens(),
            kv_capacity=self.block_manager.capacity_tokens,
            tokens_generated=self.tokens_generated,
            last_step_latency_s=self.last_step_latency_s,
            version=self.version,
            running_ids=[s.request_id for s in sch.running],
            waiting_ids=[s.request_id for s in sch.waiting],
            steps=self.steps,
            throughput_tok_s=self.throughput_tok_s,
            num_parked=len(sch.parked),
            parked_ids=[s.request_id for s in sch.parked.values()],
        )


def load_rollout_model(model_cfg, rollout_cfg, device) -> CausalLM:
    """--model.path on `device` in the engine's dtype, each tensor cast as it is read: never the
    whole fp32 model on the device first (the memory plan's rollout load peak)."""
    from staleflow.model import load_model

    return load_model(model_cfg.path, dtype=rollout_dtype(model_cfg, rollout_cfg, torch.device(device)), device=device)


def rollout_dtype(model_cfg, rollout_cfg, device: torch.device) -> torch.dtype:
    """The engine's dtype: --rollout.dtype, where auto means --model.dtype, where auto means
    bfloat16 on CUDA and float32 on CPU."""
    name = model_cfg.dtype if rollout_cfg.dtype == "auto" else rollout_cfg.dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        name, torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    )


__all__ = ["BuiltinEngine", "SequenceStatus", "load_rollout_model", "rollout_dtype"]
