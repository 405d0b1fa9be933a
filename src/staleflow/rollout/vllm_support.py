"""Pieces of the vLLM engine that live apart from it: the worker extension vLLM loads by name
in its own processes, its stat-logger tap, the per-request record and small helpers."""

from __future__ import annotations

import os
import random
from contextlib import contextmanager

import torch

from staleflow.rollout.engine import Request, RequestOutput

_MASK63 = (1 << 63) - 1


class WeightReloadExtension:
    """Mixed into vLLM's worker (worker_extension_cls): reload weights in place, from the
    Parameter Server's slot views (the runtime) or from a safetensors file (load_weights)."""

    def staleflow_reload_weights(self, path: str) -> int:
        from safetensors import safe_open

        def tensors():
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors())
        self._staleflow_refresh_tied_head()
        return 1

    def staleflow_pull_weights(self, run_id: str, reader: int, timeout: float = 60.0) -> int:
        """Reload the newest published version straight from the Parameter Server; returns it.

        The worker attaches once as reader index ``reader`` (CUDA IPC pieces: each GPU found by
        its UUID, whatever this process's CUDA_VISIBLE_DEVICES) and streams the slot's tensors
        into vLLM's parameters under the slot's shared lock: a parameter held whole by one piece
        on this GPU is passed as the slot's own view, others are assembled on this GPU from the
        pieces (peer copies); vLLM's weight loaders copy (and cast) them into place. A torn or
        overwritten version is loaded again."""
        from staleflow.servers import ParameterServer
        from staleflow.servers.slot import read_clean

        ps = getattr(self, "_staleflow_ps", None)
        if ps is None:
            ps = self._staleflow_ps = ParameterServer.attach(run_id, timeout=timeout, reader=reader)
        device = next(self.get_model().parameters()).device

        def read(version: int) -> bool:
            with ps.stream(version, device=device) as tensors:  # raises TornRead / VersionNotFound
                self.reload_weights(weights_iterator=tensors)
            return True

        version = read_clean(read, ps.latest_version, 4, "staleflow_pull_weights")
        self._staleflow_refresh_tied_head()
        return version

    def staleflow_detach(self) -> int:
        """Release this worker's Parameter Server reader indices (before the engine shuts down)."""
        ps = getattr(self, "_staleflow_ps", None)
        if ps is not None:
            ps.close()
            self._staleflow_ps = None
        return 1

    def _staleflow_refresh_tied_head(self) -> None:
        """A tied lm_head receives no tensor of its own, so vLLM's layer-wise reload leaves its
        processed copy (the CPU backend's packed GEMM weight) stale: re-derive it from the freshly
        loaded embedding."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

        for module in self.get_model().modules():
            if isinstance(module, ParallelLMHead) and isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)


class _StatsTap:
    """A vLLM stat logger that keeps the newest SchedulerStats (running, waiting, KV usage)."""

    def __init__(self, holder: dict):
        self.holder = holder

    def record(self, scheduler_stats=None, iteration_stats=None, mm_cache_stats=None, engine_idx=0, **_):
        if scheduler_stats is not None:
            self.holder["running"] = int(scheduler_stats.num_running_reqs)
            self.holder["waiting"] = int(scheduler_stats.num_waiting_reqs)
            self.holder["kv_usage"] = float(scheduler_stats.kv_cache_usage)

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, *args, **kwargs):
        pass


class _Live:
    """One request inside the engine: its prompt, what it generated so far, its vLLM id."""

    __slots__ = ("request_id", "prompt_ids", "params", "seed", "output_ids", "logprobs", "versions", "vid")

    def __init__(self, request: Request, seed: int):
        self.request_id = request.request_id
        self.prompt_ids = [int(t) for t in request.prompt_ids]
        self.params = request.params
        self.seed = seed
        self.output_ids = [int(t) for t in request.output_ids]
        self.logprobs = [float(x) for x in request.output_logprobs]
        self.versions = [int(v) for v in request.output_versions]
        self.vid = ""

    def output(self, reason) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            output_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=reason,
            seed=self.seed,
        )


def _segment_seed(seed: int, n_out: int) -> int:
    """vLLM restarts a request's random stream at its seed: a resumed segment gets a derived seed."""
    if n_out == 0:
        return seed & _MASK63
    return random.Random(f"{seed}:{n_out}").getrandbits(63)


def _checkpoint_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, read from the safetensors headers (no tensor data)."""
    from safetensors import safe_open

    from staleflow.model.hf import safetensors_files

    shapes = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def vllm_kv_cache_bytes(args, dtype, max_kv_tokens: int, block_size: int, cuda: bool) -> tuple[int, int]:
    """(kv_cache_memory_bytes, token capacity) VllmEngine asks vLLM for: whole blocks of
    --rollout.max-kv-tokens (blocks of 32 tokens on vLLM's CPU backend), K and V per layer."""
    if not cuda and block_size % 32:
        block_size = -(-block_size // 32) * 32  # vLLM's CPU attention takes multiples of 32 only
    tokens = int(max_kv_tokens) // block_size * block_size
    itemsize = (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize
    return tokens * 2 * args.num_layers * args.num_kv_heads * args.head_dim * itemsize, tokens


@contextmanager
def _visible_devices(devices: str | None):
    """CUDA_VISIBLE_DEVICES = ``devices`` while vLLM starts its engine process (which inherits it)."""
    if devices is None:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
