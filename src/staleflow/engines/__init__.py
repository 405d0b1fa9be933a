"""Rollout engines as registered backends: what each engine brings to a run, in one place per engine.

    from staleflow.engines import ENGINES, EngineBackend, engine_backend, register_engine
    engine_backend(cfg).build(ctx, model, gpu_share)    # --rollout.engine builtin | vllm | pkg.module:Name

backend.py is the interface and the registry; builtin.py and vllm.py are the two built-in entries
(the engines themselves are in rollout/). A new engine is one module with one EngineBackend
subclass: named by its import path, or registered here with one line (docs/extending.md).
"""

from staleflow.engines import builtin, vllm  # noqa: F401  (each registers its backend)
from staleflow.engines.backend import ENGINES, EngineBackend, engine_backend, register_engine

__all__ = ["ENGINES", "EngineBackend", "engine_backend", "register_engine"]
