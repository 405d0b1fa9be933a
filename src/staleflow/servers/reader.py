"""The pull side of the Parameter Server (rollout ranks, vLLM workers): clean copies of a published
slot into a reader's tensors. ``ParameterServer`` (parameter.py) is this plus the push side; the
header, the lock and the seqlock stamp are slot.py's, the merged copies copy_plan.py's."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from staleflow.servers.copy_plan import copy_pairs
from staleflow.servers.errors import ServerError, TornRead, VersionNotFound
from staleflow.servers.layout import dtype_of
from staleflow.servers.slot import PUBLISHED, _Slot, read_clean
from staleflow.servers.transport import sync_device


class SlotReader:
    """Needs ``slots``, ``layout``, ``device``, ``node``, ``local`` (the pieces this node holds), ``holds_all``,
    ``_index`` (name -> entry), ``_rows`` (name -> rows of each piece), ``published_versions()`` and
    ``latest_version()`` from the ParameterServer. Only this node's pieces are read here: where another
    node holds some (FSDP across nodes), remote_weights.py brings the rest."""

    last_copies = 0
    """Copies the last ``pull`` issued (adjacent parameters merged: copy_plan.py)."""

    def pull(
        self, version: int, out: dict[str, torch.Tensor] | None = None, retries: int = 3
    ) -> dict[str, torch.Tensor]:
        """Copy published ``version`` into ``out`` in place (or into new tensors) and return it.

        ``out`` needs every layout name with the layout's shape (any dtype/device, any strides:
        copy_ casts); only the rows this node holds are written. Raises VersionNotFound when the
        version is not published or was already overwritten; a torn copy is retried (``out`` then
        holds the clean retry).
        """
        out = self._prepare(out)
        try:
            read_clean(
                lambda v: self._read(v, out), lambda: version, retries + 1, f"pull({version})", follow_newest=False
            )
        except VersionNotFound:
            self._not_found(version)
        return out

    def pull_latest(
        self, out: dict[str, torch.Tensor] | None = None, retries: int = 3
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Copy the newest published version; returns (version, tensors)."""
        out = self._prepare(out)
        return read_clean(lambda v: self._read(v, out), self.latest_version, retries + 2, "pull_latest"), out

    def _read(self, version: int, out: dict[str, torch.Tensor]) -> bool | None:
        sl = self._slot_of(version)
        return None if sl is None else self._copy(sl, version, out)

    def read_local(self, version: int, out: dict[str, torch.Tensor]) -> bool | None:
        """One copy of this node's rows of ``version`` into ``out``: True clean, False torn, None when
        this node no longer (or not yet) holds it. The caller retries (remote_weights.py)."""
        return self._read(version, out)

    @contextmanager
    def stream(
        self, version: int, device: str | torch.device | None = None
    ) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        """Hold published ``version`` (shared lock) and yield an iterator of (name, whole tensor on
        ``device``): the slot's own view where one piece holds the parameter on that device, else a
        tensor assembled from the pieces. Use the tensors inside the block; on leaving it the
        stamp is checked and a change raises TornRead (load again). Only where this node holds
        every piece."""
        if not self.holds_all:
            raise ServerError(
                f"stream({version}): node {self.node} holds only pieces {self.local} of the Parameter Server; "
                f"the others are on other nodes (servers/remote_weights.py pulls them)"
            )
        sl = self._slot_of(version)
        if sl is None:
            self._not_found(version)
        device = torch.device(device) if device is not None else self.device
        fcntl.flock(sl.lock_fd, fcntl.LOCK_SH)
        try:
            before = sl.header()
            if before[0] != PUBLISHED or before[1] != version or before[2] & 1:
                self._not_found(version)
            self._check_mapped(sl)
            yield self._tensors(sl, device)
            for dev in {device} | {t.device for views in sl.views if views for t in list(views.values())[:1]}:
                sync_device(dev)
            if sl.header() != before:
                raise TornRead(f"stream({version}): the slot changed while it was read; load it again")
        finally:
            fcntl.flock(sl.lock_fd, fcntl.LOCK_UN)

    def _tensors(self, sl: _Slot, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        for e in self.layout.entries:
            held = [p for p in self.local if self._rows[e.name][p][1] > self._rows[e.name][p][0]]
            if len(held) == 1 and sl.views[held[0]][e.name].device == device:
                yield e.name, sl.views[held[0]][e.name]
                continue
            t = torch.empty(e.shape, dtype=dtype_of(e.dtype), device=device)
            self._copy_param(sl, e.name, t)
            yield e.name, t

    def _prepare(self, out: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        if out is None:
            return self.layout.empty(self.device)
        self._check_out(out)
        return out

    def _check_mapped(self, sl: _Slot) -> None:
        missing = [p for p in self.local if sl.views[p] is None]
        if missing:
            raise ServerError(
                f"this process has not mapped pieces {missing} of the parameter server: "
                f"attach(run_id, reader=<its reader index>) to pull"
            )

    def _copy_param(self, sl: _Slot, name: str, dst: torch.Tensor) -> None:
        for p in self.local:
            a, b = self._rows[name][p]
            if b > a:
                src = sl.views[p][name]
                (dst if dst.dim() == 0 else dst[a:b]).copy_(src)

    @torch.no_grad()
    def _copy(self, sl: _Slot, version: int, out: dict[str, torch.Tensor]) -> bool | None:
        """Copy ``sl`` under its shared lock: None if it no longer holds ``version``, else
        whether the copy is clean (seqlock stamp unchanged across it)."""
        fcntl.flock(sl.lock_fd, fcntl.LOCK_SH)
        try:
            before = sl.header()
            st, v, stamp = before
            if st != PUBLISHED or v != version or stamp & 1:
                return None
            self._check_mapped(sl)
            devices = set()
            pairs = copy_pairs(self.layout.entries, self._rows, sl.views, out)
            for src, dst in pairs:  # on the reader's device where its pieces are mapped there
                dst.copy_(src)
                devices.add(dst.device)
            self.last_copies = len(pairs)
            for views in sl.views:
                if views:
                    devices.update(t.device for t in list(views.values())[:1])
            for dev in devices:
                sync_device(dev)
            return sl.header() == before
        finally:
            fcntl.flock(sl.lock_fd, fcntl.LOCK_UN)

    def _slot_of(self, version: int) -> _Slot | None:
        for sl in self.slots:
            st, v, _ = sl.header()
            if st == PUBLISHED and v == version:
                return sl
        return None

    def _not_found(self, version: int):
        held = self.published_versions()
        raise VersionNotFound(
            f"pull(version={version}): not available (published slots hold {held or 'nothing'}); "
            f"pull the latest_version() instead"
        )

    def _check_out(self, out: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self._index if n not in out]
        extra = [n for n in out if n not in self._index]
        if missing or extra:
            raise KeyError(f"pull(out=...): names differ from the layout (missing {missing[:3]}, unknown {extra[:3]})")
        for name, t in out.items():
            e = self._index[name]
            if tuple(t.shape) != e.shape:
                raise ValueError(f"pull(out=...): {name!r} has shape {tuple(t.shape)}, the layout says {e.shape}")
