"""Parameter Server: versioned, double-buffered weight slots that rollout instances pull.

Two slots, each a segment ``staleflow-<run_id>-ps-<slot>``:

    slot header (64 B): magic, slot u32, state u32 (EMPTY/FILLING/PUBLISHED), version i64,
                        stamp u64 (seqlock: odd while filling), data offset, layout and
                        CUDA-handle lengths
    ParamLayout (msgpack), CUDA IPC handle (device slots only)
    data (CPU transport): the flat weights, laid out by the layout

Push (trainer ranks; the creator of the server is the leader)::

    slot = ps.begin_push(v)        # leader claims the slot not holding the newest version;
                                   # the others wait until the leader has claimed it
    ps.write_shard(name, shard, offset_in_param)   # every rank writes its own shard
    dist.barrier(trainer_group)
    ps.publish(v)                  # leader only

Pull (rollout ranks): ``latest_version()``, ``pull(v, out=tensors)`` copies in place,
``pull_latest(out)`` returns (version, tensors).

Readers never return a torn slot, by two independent guards:
1. a lock per slot (``flock`` on the slot file): a reader holds it shared while copying and the
   leader takes it exclusively to claim a slot, so a push never overwrites a slot being copied.
   flock is per open file, so it also separates readers and writers living in one process;
   the syscalls are full memory barriers;
2. a seqlock stamp, checked before and after the copy (after a device sync on CUDA): a change
   means the copy raced a writer that bypassed the lock; it is retried, then ``TornRead``.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time

import torch

from staleflow.servers.errors import ServerError, TornRead, VersionNotFound
from staleflow.servers.layout import ParamLayout
from staleflow.servers.segment import KIND_PARAM, Segment, check_run_id, segment_path
from staleflow.servers.transport import cuda_slot_create, cuda_slot_open, cuda_slot_release, sync_device

SLOT_HEADER = struct.Struct("<8sIIqQQII")  # magic, slot, state, version, stamp, data offset, layout len, ipc len
SLOT_MAGIC = b"STLFSLOT"
EMPTY, FILLING, PUBLISHED = 0, 1, 2
_STATE, _VERSION, _STAMP = 12, 16, 24  # byte offsets of the mutable header fields
NUM_SLOTS = 2


def slot_name(run_id: str, slot: int) -> str:
    return f"staleflow-{check_run_id(run_id)}-ps-{slot}"


class _Slot:
    """One mapped slot: its segment, a lock fd, and the flat uint8 weights (CPU view or CUDA tensor)."""

    def __init__(self, seg: Segment, slot: int, layout: ParamLayout, flat: torch.Tensor):
        self.seg, self.slot, self.flat = seg, slot, flat
        self.views = layout.views(flat)
        self.lock_fd = os.open(segment_path(seg.name), os.O_RDWR)

    def header(self) -> tuple[int, int, int]:
        """(state, version, stamp)."""
        return (struct.unpack_from("<I", self.seg.buf, _STATE)[0], struct.unpack_from("<q", self.seg.buf, _VERSION)[0],
                struct.unpack_from("<Q", self.seg.buf, _STAMP)[0])

    def set(self, state: int | None = None, version: int | None = None, bump: bool = False) -> None:
        if bump:
            struct.pack_into("<Q", self.seg.buf, _STAMP, struct.unpack_from("<Q", self.seg.buf, _STAMP)[0] + 1)
        if version is not None:
            struct.pack_into("<q", self.seg.buf, _VERSION, version)
        if state is not None:
            struct.pack_into("<I", self.seg.buf, _STATE, state)

    def close(self) -> None:
        self.views = self.flat = None
        os.close(self.lock_fd)
        self.seg.close()


class ParameterServer:
    """Both slots of a run. ``create`` on the trainer leader, ``attach`` on every other rank."""

    def __init__(self, slots: list[_Slot], layout: ParamLayout, leader: bool, device: torch.device):
        self.slots, self.layout, self.leader, self.device = slots, layout, leader, device
        self._index = layout.index()
        self._filling: _Slot | None = None

    @classmethod
    def create(cls, run_id: str, layout: ParamLayout, device: str | torch.device = "cpu") -> ParameterServer:
        """Create both slots (leader). ``device`` cpu: shared memory; cuda[:i]: GPU slots shared by CUDA IPC."""
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"ParameterServer device={device} is invalid: use cpu or cuda[:index]")
        lay = layout.encode()
        slots = []
        try:
            for s in range(NUM_SLOTS):
                name = slot_name(run_id, s)
                ipc, flat = b"", None
                if device.type == "cuda":
                    flat, ipc = cuda_slot_create(name, layout.nbytes, device)
                data_off = (SLOT_HEADER.size + len(lay) + len(ipc) + 4095) // 4096 * 4096
                seg = Segment.create(name, data_off + (layout.nbytes if flat is None else 0), KIND_PARAM)
                seg.buf[SLOT_HEADER.size:SLOT_HEADER.size + len(lay)] = lay
                seg.buf[SLOT_HEADER.size + len(lay):SLOT_HEADER.size + len(lay) + len(ipc)] = ipc
                SLOT_HEADER.pack_into(seg.buf, 0, SLOT_MAGIC, s, EMPTY, -1, 0, data_off, len(lay), len(ipc))
                slots.append(_Slot(seg, s, layout, flat if flat is not None else seg.u8[data_off:]))
        except BaseException:
            for sl in slots:
                sl.close()
                sl.seg.unlink()
            raise
        return cls(slots, layout, leader=True, device=device)

    @classmethod
    def attach(cls, run_id: str, timeout: float = 0.0) -> ParameterServer:
        """Attach to a run's server (trainer non-leaders write shards; rollout ranks pull)."""
        slots, layout, device = [], None, torch.device("cpu")
        for s in range(NUM_SLOTS):
            seg = Segment.attach(slot_name(run_id, s), KIND_PARAM, timeout)
            magic, got, _, _, _, data_off, n_lay, n_ipc = SLOT_HEADER.unpack_from(seg.buf, 0)
            if magic != SLOT_MAGIC or got != s:
                raise ServerError(f"segment {seg.name} is not parameter-server slot {s}")
            layout = ParamLayout.decode(bytes(seg.buf[SLOT_HEADER.size:SLOT_HEADER.size + n_lay]))
            if n_ipc:
                blob = bytes(seg.buf[SLOT_HEADER.size + n_lay:SLOT_HEADER.size + n_lay + n_ipc])
                flat = cuda_slot_open(seg.name, blob)
                device = flat.device
            else:
                flat = seg.u8[data_off:]
            slots.append(_Slot(seg, s, layout, flat))
        return cls(slots, layout, leader=False, device=device)

    def close(self) -> None:
        """Unmap the slots; the leader also removes them (as it would at exit)."""
        for sl in self.slots:
            name = sl.seg.name
            sl.close()
            if self.leader:
                sl.seg.unlink()
                cuda_slot_release(name)
        self.slots = []

    # -- state ----------------------------------------------------------------------------------
    def published_versions(self) -> list[int]:
        return sorted(v for st, v, _ in (sl.header() for sl in self.slots) if st == PUBLISHED)

    def latest_version(self) -> int | None:
        """Newest published version, or None before the first publish."""
        vs = self.published_versions()
        return vs[-1] if vs else None

    # -- push (trainer ranks) -------------------------------------------------------------------
    def begin_push(self, version: int, timeout: float = 60.0) -> int:
        """Start filling ``version``; returns the slot index. Leader claims, others wait for the claim."""
        latest = self.latest_version()
        if latest is not None and version <= latest:
            raise ValueError(f"begin_push(version={version}) is invalid: version {latest} is already published; "
                             f"push increasing versions")
        deadline = time.monotonic() + timeout
        if not self.leader:
            while True:
                for sl in self.slots:
                    st, v, _ = sl.header()
                    if st == FILLING and v == version:
                        self._filling = sl
                        return sl.slot
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"begin_push({version}): the leader did not claim a slot within {timeout}s")
                time.sleep(0.0005)
        # Leader: the slot not holding the newest published version (slot 0 before any publish).
        target = min(self.slots, key=lambda sl: (sl.header()[0] == PUBLISHED, sl.header()[1]))
        while True:  # exclusive lock: no reader is copying this slot, and none can start
            try:
                fcntl.flock(target.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"begin_push({version}): slot {target.slot} stayed locked by a reader "
                                       f"for {timeout}s (a reader hung mid-copy?)") from None
                time.sleep(0.0002)
        try:
            target.set(bump=True)  # stamp odd: filling
            target.set(state=FILLING, version=version)
        finally:
            fcntl.flock(target.lock_fd, fcntl.LOCK_UN)
        self._filling = target
        return target.slot

    def write_shard(self, name: str, tensor: torch.Tensor, offset_in_param: int = 0) -> None:
        """Copy this rank's shard of parameter ``name`` (flattened) at element ``offset_in_param``.

        A dim-0 shard of rows [a, b) of a [N, ...] parameter starts at element a * prod(shape[1:]).
        The shard is cast to the slot dtype if they differ.
        """
        sl = self._filling
        if sl is None:
            raise ServerError(f"write_shard({name!r}) before begin_push: call begin_push(version) first")
        entry = self._index.get(name)
        if entry is None:
            raise KeyError(f"write_shard: parameter {name!r} is not in the layout (e.g. {self.layout.names()[:3]})")
        n = tensor.numel()
        if offset_in_param < 0 or offset_in_param + n > entry.numel:
            raise ValueError(f"write_shard({name!r}): elements [{offset_in_param}, {offset_in_param + n}) fall "
                             f"outside the parameter's {entry.numel} elements")
        st, v, _ = sl.header()
        if st != FILLING:
            raise ServerError(f"write_shard({name!r}): slot {sl.slot} is no longer filling (state {st}, "
                              f"version {v}); call begin_push for the next version")
        dst = sl.views[name].view(-1)[offset_in_param:offset_in_param + n]
        dst.copy_(tensor.detach().reshape(-1))
        sync_device(dst.device)
        if tensor.device != dst.device:
            sync_device(tensor.device)

    def publish(self, version: int) -> None:
        """Make ``version`` pullable (leader only, after every rank finished its write_shard calls)."""
        if not self.leader:
            raise ServerError("publish: only the leader (the process that created the server) publishes")
        sl = self._filling
        st, v, _ = sl.header() if sl is not None else (EMPTY, -1, 0)
        if sl is None or st != FILLING or v != version:
            raise ServerError(f"publish({version}): no slot is filling version {version} "
                              f"(call begin_push({version}) and write the shards first)")
        sl.set(state=PUBLISHED)
        sl.set(bump=True)  # stamp even: stable
        self._filling = None

    # -- pull (rollout ranks) -------------------------------------------------------------------
    def pull(self, version: int, out: dict[str, torch.Tensor] | None = None,
             retries: int = 3) -> dict[str, torch.Tensor]:
        """Copy published ``version`` into ``out`` in place (or into new tensors) and return it.

        ``out`` needs every layout name with the layout's shape (any dtype/device: copy_ casts).
        Raises VersionNotFound when the version is not published or was already overwritten.
        """
        out = self._prepare(out)
        for _ in range(retries + 1):
            sl = self._slot_of(version)
            clean = None if sl is None else self._copy(sl, version, out)
            if clean is None:
                self._not_found(version)
            if clean:
                return out
        raise TornRead(f"pull({version}): the slot changed during each of {retries + 1} copies; "
                       f"a writer is bypassing the slot lock")

    def pull_latest(self, out: dict[str, torch.Tensor] | None = None,
                    retries: int = 3) -> tuple[int, dict[str, torch.Tensor]]:
        """Copy the newest published version; returns (version, tensors)."""
        out = self._prepare(out)
        for _ in range(retries + 2):
            version = self.latest_version()
            if version is None:
                raise VersionNotFound("pull_latest: no version has been published yet; wait for the first push")
            sl = self._slot_of(version)
            if sl is not None and self._copy(sl, version, out):
                return version, out
        raise TornRead(f"pull_latest: the newest slot changed during each of {retries + 2} copies")

    def _prepare(self, out: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        if out is None:
            return self.layout.empty(self.device)
        self._check_out(out)
        return out

    def _copy(self, sl: _Slot, version: int, out: dict[str, torch.Tensor]) -> bool | None:
        """Copy ``sl`` under its shared lock: None if it no longer holds ``version``, else
        whether the copy is clean (seqlock stamp unchanged across it)."""
        fcntl.flock(sl.lock_fd, fcntl.LOCK_SH)
        try:
            before = sl.header()
            st, v, stamp = before
            if st != PUBLISHED or v != version or stamp & 1:
                return None
            for name, dst in out.items():
                dst.copy_(sl.views[name])
            for dev in {sl.flat.device, *(t.device for t in out.values())}:
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
        raise VersionNotFound(f"pull(version={version}): not available (published slots hold {held or 'nothing'}); "
                              f"pull the latest_version() instead")

    def _check_out(self, out: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self._index if n not in out]
        extra = [n for n in out if n not in self._index]
        if missing or extra:
            raise KeyError(f"pull(out=...): names differ from the layout (missing {missing[:3]}, unknown {extra[:3]})")
        for name, t in out.items():
            e = self._index[name]
            if tuple(t.shape) != e.shape:
                raise ValueError(f"pull(out=...): {name!r} has shape {tuple(t.shape)}, the layout says {e.shape}")
