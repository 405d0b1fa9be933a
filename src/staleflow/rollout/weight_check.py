"""check_weights: what a weight load into the built-in engine must pass before anything is copied.

    check_weights(items, dict(model.named_parameters(remove_duplicate=False)), version, engine.version, strict)

Names are HF names (a tied ``lm_head.weight`` is accepted: it names the embedding's parameter), shapes
match, dtypes are floating, every parameter is covered when strict (by identity, so either name of a
tied pair covers both), and versions only move forward. The first problem is an EngineError naming it;
nothing was loaded.
"""

from __future__ import annotations

import torch

from staleflow.rollout.engine import EngineError


def check_weights(items: list, params: dict[str, torch.Tensor], version, current: int, strict: bool) -> None:
    if not isinstance(version, int) or version < current:
        raise EngineError(
            f"load_weights: version={version!r} is older than the engine's version {current}: versions only move forward"
        )
    covered = set()
    for name, t in items:
        if name not in params:
            raise EngineError(
                f"load_weights: unknown parameter name {name!r} (expected HF names such as "
                f"{next(iter(params))!r}); nothing was loaded"
            )
        p = params[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise EngineError(f"load_weights: {name!r} has shape {got}, expected {tuple(p.shape)}; nothing was loaded")
        if not t.is_floating_point():
            raise EngineError(
                f"load_weights: {name!r} has dtype {t.dtype}, expected a floating dtype; nothing was loaded"
            )
        covered.add(id(p))
    if strict:
        missing = [n for n, p in params.items() if id(p) not in covered]
        if missing:
            raise EngineError(
                f"load_weights: {len(missing)} parameters missing, e.g. {missing[0]!r}; pass "
                f"every parameter or strict=False; nothing was loaded"
            )
