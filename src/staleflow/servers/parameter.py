"""Parameter Server: versioned, double-buffered weight slots that rollout instances pull.

Two slots per trainer node, each a segment ``staleflow-<run_id>-ps-<slot>`` (``-n<node>`` off node 0)
made by the node's first trainer rank, written in full before it appears: a header (slot.py: state
EMPTY/FILLING/PUBLISHED, version, seqlock stamp, data offset, layout length, pieces, reader handles,
node), the ParamLayout and the piece table (msgpack) and, on CPU, the node's piece of the weights.
A slot is split into pieces (``PieceSpec``, placed by cluster/placement.py): on CUDA one per trainer
rank, on that rank's GPU (pieces.py), so each trainer writes only into its own GPU; on CPU one per
trainer node, in that node's shared memory. Every node's server holds the pieces of its own node;
a puller copies the others from their owners (remote_weights.py).

Push (trainer ranks; the creator of a node's server is that node's leader)::

    ps = ParameterServer.create(run_id, layout, "cuda:0", pieces=P, readers=K)  # leader, owns piece 0
    ps = ParameterServer.create(run_id, layout, "cpu", pieces=table, node=1)    # node 1's leader
    ps = ParameterServer.attach(run_id, piece=r, device="cuda:r", node=n)       # trainer rank r
    slot = ps.begin_push(v)        # the node leader claims the slot not holding the newest version;
                                   # the others wait until it has claimed it
    ps.write_shard(name, shard, offset_in_param)   # queued copies (cast to the slot dtype)
    ps.end_push()                  # one device sync per push, not one per parameter
    dist.barrier(trainer_group)
    ps.publish(v)                  # every node leader, after the barrier

Pull (rollout ranks, each with its own reader index): ``attach(run_id, reader=i, node=n)``,
``latest_version()``, ``pull(v, out=tensors)`` copies in place (e.g. straight into an engine's
parameters, cast on their device) the rows this node holds, ``pull_latest(out)`` returns (version,
tensors), ``stream(v, device)`` yields whole tensors one by one (a vLLM worker's ``reload_weights``;
only where this node holds every piece).

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
from collections.abc import Sequence

import msgspec
import torch

from staleflow.servers.errors import ServerError
from staleflow.servers.layout import ParamLayout, PieceSpec, equal_pieces
from staleflow.servers.pieces import Piece
from staleflow.servers.reader import SlotReader
from staleflow.servers.segment import KIND_PARAM, Segment
from staleflow.servers.slot import EMPTY, FILLING, NUM_SLOTS, PUBLISHED, SLOT_HEADER, SLOT_MAGIC, _Slot, slot_name
from staleflow.servers.transport import sync_device

__all__ = ["EMPTY", "FILLING", "PUBLISHED", "ParameterServer", "slot_name"]


class ParameterServer(SlotReader):
    """Both slots of a run. ``create`` on the trainer leader, ``attach`` on every other rank."""

    def __init__(
        self,
        slots: list[_Slot],
        layout: ParamLayout,
        leader: bool,
        device: torch.device,
        table: tuple[PieceSpec, ...],
        node: int = 0,
    ):
        self.slots, self.layout, self.leader, self.device = slots, layout, leader, device
        self.table, self.node, self.pieces = table, node, len(table)
        self.local = [p for p, spec in enumerate(table) if spec.node == node]
        """Indices of the pieces this node holds (all of them on a single-node run)."""
        self._index = layout.index()
        self._rows = {e.name: [spec.rows(e.shape) for spec in table] for e in layout.entries}
        self._filling: _Slot | None = None
        self._dirty: set[torch.device] = set()

    @property
    def holds_all(self) -> bool:
        """This node's pieces hold every row of every parameter (no piece must come from another node)."""
        return {(self.table[p].lo, self.table[p].hi) for p in self.local} == {(s.lo, s.hi) for s in self.table}

    @classmethod
    def create(
        cls,
        run_id: str,
        layout: ParamLayout,
        device: str | torch.device = "cpu",
        pieces: int | Sequence[PieceSpec] = 1,
        readers: int = 0,
        node: int = 0,
    ) -> ParameterServer:
        """Create ``node``'s two slots (its leader). ``device`` cpu: shared memory holding the node's one
        piece; cuda[:i]: GPU pieces shared by CUDA IPC, this process owning the node's first piece, with
        ``readers`` reader indices. ``pieces``: a count of equal pieces on one node, or the run's table."""
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"ParameterServer device={device} is invalid: use cpu or cuda[:index]")
        table = equal_pieces(pieces) if isinstance(pieces, int) and pieces >= 1 else tuple(pieces or ())
        local = [p for p, spec in enumerate(table) if spec.node == node]
        cuda = device.type == "cuda"
        if not local or readers < 0 or (not cuda and len(local) != 1):
            raise ValueError(
                f"ParameterServer pieces={pieces}, readers={readers} are invalid: pieces >= 1 with at least one on "
                f"node {node} (exactly 1 on cpu: one shared-memory slot per node), readers >= 0"
            )
        lay = layout.encode()
        tab = msgspec.msgpack.encode(table)
        first = layout.piece(table[local[0]])
        slots: list[_Slot] = []
        own: Piece | None = None
        meta = SLOT_HEADER.size + len(lay) + len(tab)
        try:
            for s in range(NUM_SLOTS):
                own = Piece.create(run_id, s, local[0], first, device, readers) if cuda else None
                data_off = 0 if cuda else (meta + 4095) // 4096 * 4096

                def init(buf: memoryview, s=s, data_off=data_off) -> None:
                    SLOT_HEADER.pack_into(
                        buf, 0, SLOT_MAGIC, s, EMPTY, -1, 0, data_off, len(lay), len(table), readers, node, len(tab)
                    )
                    buf[SLOT_HEADER.size : SLOT_HEADER.size + len(lay)] = lay
                    buf[SLOT_HEADER.size + len(lay) : meta] = tab

                size = meta if cuda else data_off + first.nbytes
                seg = Segment.create(slot_name(run_id, s, node), size, KIND_PARAM, init=init)
                views: list = [None] * len(table)
                held: list = [None] * len(table)
                views[local[0]] = own.views if cuda else first.views(seg.u8[data_off:])
                held[local[0]] = own
                slots.append(_Slot(seg, s, views, held))
                own = None
        except BaseException:
            if own is not None:
                own.close(wait_readers_s=0)
            for sl in slots:
                sl.close()
                sl.seg.unlink()
            raise
        return cls(slots, layout, leader=True, device=device, table=table, node=node)

    @classmethod
    def attach(
        cls,
        run_id: str,
        timeout: float = 0.0,
        *,
        reader: int | None = None,
        piece: int | None = None,
        device: str | torch.device | None = None,
        node: int = 0,
    ) -> ParameterServer:
        """Attach to ``node``'s server of a run. CPU slots: every rank reads and writes the shared memory.
        GPU pieces: a trainer rank passes ``piece`` (its own, on this node) and ``device`` and creates its
        piece there; a puller passes its ``reader`` index and maps every piece of this node, on its own
        GPU ``device`` where given (copies then run on that GPU's stream: transport.cuda_piece_open);
        with neither, only the slot headers are attached (versions, not weights)."""
        deadline = time.monotonic() + timeout
        slots: list[_Slot] = []
        try:
            for s in range(NUM_SLOTS):
                seg = Segment.attach(slot_name(run_id, s, node), KIND_PARAM, max(0.0, deadline - time.monotonic()))
                magic, got, _, _, _, data_off, n_lay, pieces, readers, got_node, n_tab = SLOT_HEADER.unpack_from(
                    seg.buf, 0
                )
                if magic != SLOT_MAGIC or got != s or got_node != node:
                    seg.close()
                    raise ServerError(f"segment {seg.name} is not parameter-server slot {s} of node {node}")
                at = SLOT_HEADER.size
                layout = ParamLayout.decode(bytes(seg.buf[at : at + n_lay]))
                table = msgspec.msgpack.decode(
                    bytes(seg.buf[at + n_lay : at + n_lay + n_tab]), type=tuple[PieceSpec, ...]
                )
                if len(table) != pieces:
                    seg.close()
                    raise ServerError(
                        f"segment {seg.name}: its piece table has {len(table)} pieces, its header {pieces}"
                    )
                local = [p for p, spec in enumerate(table) if spec.node == node]
                sl = _Slot(seg, s, [None] * pieces, [None] * pieces)
                slots.append(sl)
                if data_off:
                    sl.views[local[0]] = layout.piece(table[local[0]]).views(seg.u8[data_off:])
                    continue
                if piece is not None:
                    if piece not in local or device is None:
                        raise ServerError(
                            f"attach(piece={piece}, device={device}): node {node} holds pieces {local}; "
                            f"pass the owning trainer rank's piece and its GPU"
                        )
                    sl.pieces[piece] = Piece.create(
                        run_id, s, piece, layout.piece(table[piece]), torch.device(device), readers
                    )
                    sl.views[piece] = sl.pieces[piece].views
                map_on = torch.device(device) if device is not None and piece is None else None
                for p in local if reader is not None else ():
                    if sl.pieces[p] is None:
                        sl.pieces[p] = Piece.attach(
                            run_id, s, p, layout.piece(table[p]), reader, max(0.0, deadline - time.monotonic()), map_on
                        )
                        sl.views[p] = sl.pieces[p].views
        except BaseException:
            for sl in slots:
                sl.close()
            raise
        if not any(slots[0].pieces):
            dev = torch.device("cpu")
        elif device is not None:
            dev = torch.device(device)
        elif torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
        return cls(slots, layout, leader=False, device=dev, table=table, node=node)

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
        for p in self.local:  # a piece on another node is written there, by its own ranks
            a, b = self._rows[name][p]
            lo, hi = max(offset_in_param, a * row), min(offset_in_param + n, b * row)
            if lo >= hi:
                continue
            if sl.views[p] is None:
                raise ServerError(
                    f"write_shard({name!r}): elements [{lo}, {hi}) belong to piece {p}, owned by "
                    f"trainer rank {self.table[p].owner}; each rank writes only its own shard"
                )
            parts.append((sl.views[p][name].view(-1)[lo - a * row : hi - a * row], lo - offset_in_param, hi - lo))
        if sum(c for _, _, c in parts) != n:
            raise ServerError(
                f"write_shard({name!r}): elements [{offset_in_param}, {offset_in_param + n}) are not all held on "
                f"node {self.node} (its pieces {self.local}); each rank writes only its own shard"
            )
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
