"""Pieces of the vLLM engine that live apart from it: the worker extension vLLM loads by name
in its own processes, its stat-logger tap and small helpers (its request table is vllm_requests.py)."""

from __future__ import annotations

import os
import random
from contextlib import contextmanager

import torch

from staleflow.rollout.engine import EngineError

_MASK63 = (1 << 63) - 1
_SAMPLING_EPS = 1e-5  # vLLM treats temperature below this as greedy


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


def checked_weights(items, shapes: dict, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs vLLM must load: every HF parameter, shapes and dtypes checked (a
    tied lm_head is skipped); an EngineError names the first problem and nothing is loaded."""
    keep, covered = [], set()
    for name, t in items:
        if name == "lm_head.weight" and tied and name not in shapes:
            continue  # tied to the embedding: vLLM has no separate lm_head to load
        if name not in shapes:
            raise EngineError(
                f"load_weights: unknown parameter name {name!r} (expected HF names such as "
                f"{next(iter(shapes))!r}); nothing was loaded"
            )
        want = shapes[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise EngineError(f"load_weights: {name!r} has shape {got}, expected {want}; nothing was loaded")
        if not t.is_floating_point():
            raise EngineError(
                f"load_weights: {name!r} has dtype {t.dtype}, expected a floating dtype; nothing was loaded"
            )
        covered.add(name)
        keep.append((name, t))
    missing = [n for n in shapes if n not in covered and not (n == "lm_head.weight" and tied)]
    if missing:
        raise EngineError(
            f"load_weights: {len(missing)} parameters missing, e.g. {missing[0]!r}; pass every "
            f"parameter (vLLM reloads whole checkpoints); nothing was loaded"
        )
    return keep


def start_llm_engine(
    folder: str,
    *,
    dtype: str,
    seed: int,
    max_model_len: int,
    max_running: int,
    prefill_chunk_tokens: int,
    block_size: int,
    kv_bytes: int,
    logprobs_mode: str,
    enforce_eager: bool,
    gpu_memory_utilization: float | None,
    visible_devices: str | None,
    multiprocess: bool,
    stat_sink: dict,
    prefix_caching: bool = True,
):
    """vLLM's LLMEngine for token-id prompts (no tokenizer), chunked prefill, our KV budget and
    log-prob kind, the weight-reload worker extension, and a stat tap writing into ``stat_sink``.
    ``visible_devices``: CUDA_VISIBLE_DEVICES while the engine starts (its own GPU first).
    ``prefix_caching``: vLLM's automatic prefix caching (--rollout.prefix-sharing)."""
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    extra = {"gpu_memory_utilization": float(gpu_memory_utilization)} if gpu_memory_utilization else {}
    engine_args = EngineArgs(
        model=folder,
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=int(seed),
        max_model_len=max_model_len,
        max_num_seqs=int(max_running),
        max_num_batched_tokens=max(int(prefill_chunk_tokens), int(max_running)),
        enable_chunked_prefill=True,
        enable_prefix_caching=prefix_caching,  # GRPO siblings share the prompt; an extend resubmits its history
        block_size=block_size,
        kv_cache_memory_bytes=kv_bytes,
        logprobs_mode=logprobs_mode,
        generation_config="vllm",
        enforce_eager=enforce_eager,
        worker_extension_cls=f"{WeightReloadExtension.__module__}.WeightReloadExtension",
        disable_log_stats=False,
        **extra,
    )
    with _visible_devices(visible_devices):
        vllm_config = engine_args.create_engine_config()
        return LLMEngine(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=True,
            stat_loggers=[lambda _cfg, _idx: _StatsTap(stat_sink)],
            multiprocess_mode=multiprocess,
        )


def check_settings(
    model_path: str,
    args,
    cuda: bool,
    *,
    max_running: int,
    prefill_chunk_tokens: int,
    max_model_len: int,
    max_kv_tokens: int,
    sampling_temperature: float,
    dtype: str,
    multiprocess: bool | None,
) -> tuple[str, bool]:
    """Refuse settings vLLM would fail on later (one EngineError naming the fix); returns the
    resolved dtype and in-process/multiprocess choice (exported as VLLM_ENABLE_V1_MULTIPROCESSING)."""
    if max_running < 1 or prefill_chunk_tokens < 1 or max_model_len < 2:
        raise EngineError(
            f"max_running={max_running}, prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1 "
            f"and max_model_len={max_model_len} >= 2"
        )
    if max_kv_tokens < max_model_len:
        raise EngineError(
            f"max_kv_tokens={max_kv_tokens} cannot hold one sequence of max_model_len="
            f"{max_model_len}: raise --rollout.max-kv-tokens or lower --rollout.max-model-len"
        )
    if sampling_temperature < 0:
        raise EngineError(f"sampling_temperature={sampling_temperature!r} is invalid: must be >= 0")
    if not cuda and args.head_dim < 32:
        raise EngineError(
            f"model {model_path!r} has head_dim={args.head_dim}: vLLM's CPU backend needs >= 32; "
            f"use --rollout.engine builtin or a larger model (e.g. smollm2-135m)"
        )
    if dtype == "auto":
        dtype = "bfloat16" if cuda else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise EngineError(f"dtype={dtype!r} is invalid: use auto, float32, bfloat16 or float16")
    if multiprocess is None:
        multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    if not multiprocess and torch.distributed.is_available() and torch.distributed.is_initialized():
        raise EngineError(
            "vLLM in-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0) cannot run in a process that "
            "already has a torch.distributed group (a torchrun rank): unset it"
        )
    # vLLM reads this variable in several places (platform setup, executor choice).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    return dtype, multiprocess


def check_logprob_kind(rid, p, logprobs_mode: str, temperature: float) -> None:
    """Refuse a request whose log-probs this engine's logprobs_mode would not report exactly."""
    greedy_t0 = p.temperature < _SAMPLING_EPS
    if logprobs_mode == "raw_logprobs":
        ok = greedy_t0 or p.temperature == 1.0
    else:
        ok = greedy_t0 or (p.temperature == temperature and p.top_p == 1.0 and p.top_k == 0)
    if not ok:
        raise EngineError(
            f"request {rid!r}: temperature={p.temperature}, top_p={p.top_p}, top_k={p.top_k} "
            f"cannot get exact untruncated log-probs from this vLLM engine (built for sampling "
            f"temperature {temperature}, logprobs_mode {logprobs_mode}); build it with "
            f"sampling_temperature={p.temperature} and no top-p/top-k, or use temperature 1"
        )
