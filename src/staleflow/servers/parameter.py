"""Parameter Server: versioned, double-buffered weight slots that rollout instances pull.

Two slots, each a segment ``staleflow-<run_id>-ps-<slot>`` made by the leader, written in full
before it appears: a header (slot.py: state EMPTY/FILLING/PUBLISHED, version, seqlock stamp,
data offset, layout length, pieces, reader handles), the ParamLayout (msgpack) and, on CPU, the
flat weights. On CUDA a slot's weights live in ``pieces`` GPU pieces (pieces.py): piece p, on
the GPU of trainer rank p, holds the rows FSDP2 gives rank p of every parameter, so each trainer
writes only into its own GPU and the slots' memory is spread evenly.

Push (trainer ranks; the creator of the server is the leader)::

    ps = ParameterServer.create(run_id, layout, "cuda:0", pieces=P, readers=K)  # leader, owns piece 0
    ps = ParameterServer.attach(run_id, piece=r, device="cuda:r")                # trainer rank r
    slot = ps.begin_push(v)        # leader claims the slot not holding the newest version;
                                   # the others wait until the leader has claimed it
    ps.write_shard(name, shard, offset_in_param)   # queued copies (cast to the slot dtype)
    ps.end_push()                  # one device sync per push, not one per parameter
    dist.barrier(trainer_group)
    ps.publish(v)                  # leader only

Pull (rollout ranks, each with its own reader index): ``attach(run_id, reader=i)``,
``latest_version()``, ``pull(v, out=tensors)`` copies in place (e.g. straight into an engine's
parameters, cast on their device), ``pull_latest(out)`` returns (version, tensors),
``stream(v, device)`` yields whole tensors one by one (a vLLM worker's ``reload_weights``).

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
import math
import time

import torch

from staleflow.servers.errors import ServerError
from staleflow.servers.layout import ParamLayout, piece_rows
from staleflow.servers.pieces import Piece
from staleflow.servers.reader import SlotReader
from staleflow.servers.segment import KIND_PARAM, Segment
from staleflow.servers.slot import EMPTY, FILLING, NUM_SLOTS, PUBLISHED, SLOT_HEADER, SLOT_MAGIC, _Slot, slot_name
from staleflow.servers.transport import sync_device

__all__ = ["EMPTY", "FILLING", "PUBLISHED", "ParameterServer", "slot_name"]


class ParameterServer(SlotReader):
    """Both slots of a run. ``create`` on the trainer leader, ``attach`` on every other rank."""

    def __init__(self, slots: list[_Slot], layout: ParamLayout, leader: bool, device: torch.device, pieces: int):
        self.slots, self.layout, self.leader, self.device, self.pieces = slots, layout, leader, device, pieces
        self._index = layout.index()
        self._rows = {e.name: [piece_rows(e.shape, pieces, p) for p in range(pieces)] for e in layout.entries}
        self._filling: _Slot | None = None
        self._dirty: set[torch.device] = set()

    @classmethod
    def create(
        cls, run_id: str, layout: ParamLayout, device: str | torch.device = "cpu", pieces: int = 1, readers: int = 0
    ) -> ParameterServer:
        """Create both slots (leader). ``device`` cpu: shared memory; cuda[:i]: GPU pieces shared by
        CUDA IPC, this process owning piece 0 of ``pieces``, with ``readers`` reader indices."""
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"ParameterServer device={device} is invalid: use cpu or cuda[:index]")
        if pieces < 1 or readers < 0 or (device.type == "cpu" and pieces != 1):
            raise ValueError(
                f"ParameterServer pieces={pieces}, readers={readers} are invalid: pieces >= 1 "
                f"(exactly 1 on cpu: one shared-memory slot), readers >= 0"
            )
        cuda = device.type == "cuda"
        lay = layout.encode()
        first = layout.split(pieces)[0]
        slots: list[_Slot] = []
        own: Piece | None = None
        try:
            for s in range(NUM_SLOTS):
                own = Piece.create(run_id, s, 0, first, device, readers) if cuda else None
                data_off = 0 if cuda else (SLOT_HEADER.size + len(lay) + 4095) // 4096 * 4096

                def init(buf: memoryview, s=s, data_off=data_off) -> None:
                    SLOT_HEADER.pack_into(buf, 0, SLOT_MAGIC, s, EMPTY, -1, 0, data_off, len(lay), pieces, readers)
                    buf[SLOT_HEADER.size : SLOT_HEADER.size + len(lay)] = lay

                size = SLOT_HEADER.size + len(lay) if cuda else data_off + layout.nbytes
                seg = Segment.create(slot_name(run_id, s), size, KIND_PARAM, init=init)
                views = [own.views] + [None] * (pieces - 1) if cuda else [layout.views(seg.u8[data_off:])]
                slots.append(_Slot(seg, s, views, [own] if cuda else ()))
                own = None
        except BaseException:
            if own is not None:
                own.close(wait_readers_s=0)
            for sl in slots:
                sl.close()
                sl.seg.unlink()
            raise
        return cls(slots, layout, leader=True, device=device, pieces=pieces)

    @classmethod
    def attach(
        cls,
        run_id: str,
        timeout: float = 0.0,
        *,
        reader: int | None = None,
        piece: int | None = None,
        device: str | torch.device | None = None,
    ) -> ParameterServer:
        """Attach to a run's server. CPU slots: every rank reads and writes the shared memory.
        GPU pieces: a trainer rank passes ``piece`` (its rank) and ``device`` and creates its own
        piece there; a puller passes its ``reader`` index and maps every piece, on its own GPU
        ``device`` where given (copies then run on that GPU's stream: transport.cuda_piece_open);
        with neither, only the slot headers are attached (versions, not weights)."""
        deadline = time.monotonic() + timeout
        slots: list[_Slot] = []
        try:
            for s in range(NUM_SLOTS):
                seg = Segment.attach(slot_name(run_id, s), KIND_PARAM, max(0.0, deadline - time.monotonic()))
                magic, got, _, _, _, data_off, n_lay, pieces, readers = SLOT_HEADER.unpack_from(seg.buf, 0)
                if magic != SLOT_MAGIC or got != s:
                    seg.close()
                    raise ServerError(f"segment {seg.name} is not parameter-server slot {s}")
                layout = ParamLayout.decode(bytes(seg.buf[SLOT_HEADER.size : SLOT_HEADER.size + n_lay]))
                if data_off:
                    slots.append(_Slot(seg, s, [layout.views(seg.u8[data_off:])]))
                    continue
                sl = _Slot(seg, s, [None] * pieces, [None] * pieces)
                slots.append(sl)
                split = layout.split(pieces)
                if piece is not None:
                    if not 0 <= piece < pieces or device is None:
                        raise ServerError(
                            f"attach(piece={piece}, device={device}): this server has pieces "
                            f"0..{pieces - 1}; pass the owning trainer rank and its GPU"
                        )
                    sl.pieces[piece] = Piece.create(run_id, s, piece, split[piece], torch.device(device), readers)
                    sl.views[piece] = sl.pieces[piece].views
                map_on = torch.device(device) if device is not None and piece is None else None
                for p in range(pieces) if reader is not None else ():
                    if sl.pieces[p] is None:
                        sl.pieces[p] = Piece.attach(
                            run_id, s, p, split[p], reader, max(0.0, deadline - time.monotonic()), map_on
                        )
                        sl.views[p] = sl.pieces[p].views
        except BaseException:
            for sl in slots:
                sl.close()
            raise
        if not slots[0].pieces:
            dev = torch.device("cpu")
        elif device is not None:
            dev = torch.device(device)
        elif torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
        return cls(slots, layout, leader=False, device=dev, pieces=len(slots[0].views))

    def close(self) -> None:
        """Unmap the slots (a piece owner first waits for its readers); the leader also removes them."""
        for sl in self.slots:
            sl.close()
            if self.leader:
                sl.seg.unlink()
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
            raise ValueError(
                f"begin_push(version={version}) is invalid: version {latest} is already published; "
                f"push increasing versions"
            )
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
                    raise TimeoutError(
                        f"begin_push({version}): slot {target.slot} stayed locked by a reader "
                        f"for {timeout}s (a reader hung mid-copy?)"
                    ) from None
                time.sleep(0.0002)
        try:
            target.set(bump=True)  # stamp odd: filling
            target.set(state=FILLING, version=version)
        finally:
            fcntl.flock(target.lock_fd, fcntl.LOCK_UN)
        self._filling = target
        return target.slot

    def write_shard(self, name: str, tensor: torch.Tensor, offset_in_param: int = 0) -> None:
        """Queue the copy of this rank's shard of parameter ``name`` (flattened) at element
        ``offset_in_param``, cast to the slot dtype; ``end_push`` waits for the copies.

        A dim-0 shard of rows [a, b) of a [N, ...] parameter starts at element a * prod(shape[1:]).
        On GPU pieces the elements must lie in pieces this process mapped (its own).
        """
        sl = self._filling
        if sl is None:
            raise ServerError(f"write_shard({name!r}) before begin_push: call begin_push(version) first")
        entry = self._index.get(name)
        if entry is None:
            raise KeyError(f"write_shard: parameter {name!r} is not in the layout (e.g. {self.layout.names()[:3]})")
        n = tensor.numel()
        if offset_in_param < 0 or offset_in_param + n > entry.numel:
            raise ValueError(
                f"write_shard({name!r}): elements [{offset_in_param}, {offset_in_param + n}) fall "
                f"outside the parameter's {entry.numel} elements"
            )
        st, v, _ = sl.header()
        if st != FILLING:
            raise ServerError(
                f"write_shard({name!r}): slot {sl.slot} is no longer filling (state {st}, "
                f"version {v}); call begin_push for the next version"
            )
        row = math.prod(entry.shape[1:])
        parts = []
        for p, (a, b) in enumerate(self._rows[name]):
            lo, hi = max(offset_in_param, a * row), min(offset_in_param + n, b * row)
            if lo >= hi:
                continue
            if sl.views[p] is None:
                raise ServerError(
                    f"write_shard({name!r}): elements [{lo}, {hi}) belong to piece {p}, owned by "
                    f"trainer rank {p}; each rank writes only its own shard"
                )
            parts.append((sl.views[p][name].view(-1)[lo - a * row : hi - a * row], lo - offset_in_param, hi - lo))
        src = tensor.detach().reshape(-1)
        for dst, at, count in parts:
            dst.copy_(src[at : at + count])
            self._dirty.add(dst.device)
        self._dirty.add(src.device)

    def end_push(self) -> None:
        """Wait for this rank's queued shard copies (every writer, before the trainer barrier)."""
        for dev in self._dirty:
            sync_device(dev)
        self._dirty.clear()

    def publish(self, version: int) -> None:
        """Make ``version`` pullable (leader only, after every rank finished its writes and end_push)."""
        if not self.leader:
            raise ServerError("publish: only the leader (the process that created the server) publishes")
        sl = self._filling
        st, v, _ = sl.header() if sl is not None else (EMPTY, -1, 0)
        if sl is None or st != FILLING or v != version:
            raise ServerError(
                f"publish({version}): no slot is filling version {version} "
                f"(call begin_push({version}) and write the shards first)"
            )
        self.end_push()
        sl.set(state=PUBLISHED)
        sl.set(bump=True)  # stamp even: stable
        self._filling = None
