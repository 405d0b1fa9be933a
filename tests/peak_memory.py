"""A dispatch mode that records every tensor an operator allocates and the peak of those still alive:
the CPU stand-in for a device allocator, used to check the memory plan against the code itself."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakAllocations(TorchDispatchMode):
    """``with PeakAllocations() as p: run()`` -> p.peak (bytes), p.allocs [(op, shape, dtype, bytes)].

    A new storage (not one of the op's inputs: views and in-place ops allocate nothing) counts
    from the op that makes it until its tensor is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.allocs: list[tuple[str, tuple, torch.dtype, int]] = []
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in inputs or key in self._sizes:
                continue
            self._sizes[key] = n
            self.live += n
            self.peak = max(self.peak, self.live)
            self.allocs.append((str(func), tuple(t.shape), t.dtype, n))
            weakref.finalize(t, self._free, key)
        return out
