"""staleflow.rollout: rollout engines behind one interface (engine.py).

    from staleflow.rollout import BuiltinEngine, Request, SamplingParams
    engine = BuiltinEngine.from_config(cfg.model, cfg.rollout)
    engine.add(Request("t0", prompt_ids, SamplingParams(max_new_tokens=64, seed=0)))
    finished = engine.step()

See docs/engine.md.
"""

from staleflow.rollout.engine import (
    CostSample,
    EngineError,
    EngineStats,
    FinishReason,
    Request,
    RolloutEngine,
    SamplingParams,
)


def __getattr__(name):
    # BuiltinEngine pulls in torch; the plain request types above do not.
    if name == "BuiltinEngine":
        from staleflow.rollout.builtin_engine import BuiltinEngine

        return BuiltinEngine
    raise AttributeError(f"module 'staleflow.rollout' has no attribute {name!r}")


__all__ = [
    "BuiltinEngine",
    "CostSample",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "Request",
    "RolloutEngine",
    "SamplingParams",
]
