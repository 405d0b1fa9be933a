"""Modules built on the meta device (shapes only), without torch._dynamo.

    with on_meta():
        model = CausalLM(args)          # every parameter on "meta", nothing drawn

nn.init's ``normal_`` on a meta tensor (nn.Embedding initialises its weight with it) runs torch's
Python meta kernel, whose first call imports torch._dynamo: 2-6 s, most of what ``staleflow check``
took before a run could start. A meta tensor has no values to draw, so here it is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def on_meta() -> Iterator[None]:
    """``torch.device("meta")`` with ``nn.init.normal_`` a no-op on meta tensors (real ones as before)."""
    normal = torch.nn.init.normal_

    def normal_(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return t if t.is_meta else normal(t, *args, **kwargs)

    torch.nn.init.normal_ = normal_
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.nn.init.normal_ = normal
