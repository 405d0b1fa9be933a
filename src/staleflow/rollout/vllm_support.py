"""Pieces of the vLLM engine that live apart from it: the worker extension vLLM loads by name
in its own processes, its stat-logger tap, the per-request record and small helpers."""

from __future__ import annotations

import random

from staleflow.rollout.engine import Request, RequestOutput

_MASK63 = (1 << 63) - 1


class WeightReloadExtension:
    """Mixed into vLLM's worker (worker_extension_cls): reload weights from a safetensors file."""

    def staleflow_reload_weights(self, path: str) -> int:
        from safetensors import safe_open

        def tensors():
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors())
        # A tied lm_head receives no tensor of its own, so vLLM's layer-wise reload leaves its
        # processed copy (the CPU backend's packed GEMM weight) stale: re-derive it from the
        # freshly loaded embedding.
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

        for module in self.get_model().modules():
            if isinstance(module, ParallelLMHead) and isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)
        return 1


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
        return RequestOutput(request_id=self.request_id, prompt_ids=list(self.prompt_ids),
                             output_ids=list(self.output_ids), logprobs=list(self.logprobs),
                             versions=list(self.versions), finish_reason=reason, seed=self.seed)


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
