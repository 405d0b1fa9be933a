"""HostStaging: a step's small index / parameter arrays, built on the host, sent to the device in ONE copy.

    staging = HostStaging(device, torch.int64)
    ids, pos, slots = staging.upload([ids_list, positions_list, slots_array])   # device views

``torch.tensor(list, device=cuda)`` copies from pageable memory and waits for the device: one
blocking synchronisation per call, several per decode step. Here every array of a step is written
into a pinned host buffer and goes up in one ``non_blocking`` copy; the device views it returns are
slices of one device buffer (valid until the next ``upload``). Two host buffers alternate, each
guarded by a CUDA event recorded after its copy: a buffer is rewritten only once its previous copy
has been read (normally long done: the step's tokens came back to the host in between). On CPU the
same code runs with plain buffers (the copy is a memcpy, the events are skipped).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64, capacity: int = 1024):
        self.device, self.dtype = torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        self.capacity = 0
        self.uploads = 0
        """Copies issued so far (one per ``upload``): what the tests count."""
        self._turn = 0
        self._grow(capacity)

    def _grow(self, n: int) -> None:
        cap = max(1024, 1 << (max(1, n) - 1).bit_length())
        if cap <= self.capacity:
            return
        if self.capacity:  # the old buffers may still be read by copies in flight
            self._wait_all()
        self.host = [torch.empty(cap, dtype=self.dtype, pin_memory=self.cuda) for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = torch.empty(cap, dtype=self.dtype, device=self.device)
        self.events: list = [None, None]
        self.capacity = cap

    def _wait_all(self) -> None:
        for ev in self.events:
            if ev is not None and not ev.query():
                ev.synchronize()

    def upload(self, parts: Sequence) -> list[torch.Tensor]:
        """Device tensors (1-D views, this buffer's dtype) holding ``parts`` (lists or numpy arrays,
        flattened), after one host-to-device copy."""
        sizes = [int(np.size(p)) for p in parts]
        total = sum(sizes)
        self._grow(total)
        turn = self._turn
        self._turn ^= 1
        ev = self.events[turn]
        if ev is not None and not ev.query():  # its last copy (two uploads ago) not read yet: rare
            ev.synchronize()
        buf = self.host_np[turn]
        offset = 0
        for p, n in zip(parts, sizes):
            if n:
                buf[offset : offset + n] = np.asarray(p).reshape(-1)
            offset += n
        if total:
            self.dev[:total].copy_(self.host[turn][:total], non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events[turn] = ev
        self.uploads += 1
        out, offset = [], 0
        for n in sizes:
            out.append(self.dev[offset : offset + n])
            offset += n
        return out


__all__ = ["HostStaging"]
