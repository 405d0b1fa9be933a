"""Weights across nodes: each Parameter Server piece owner serves its piece of a published version
to the rollout ranks of other nodes, each of which pulls on its own schedule.

    server = WeightServer(ps, piece, sock, groups, device)        # a thread on each piece owner
    puller = RemoteWeights({piece: sock}, table, group, device, local=ps_of_this_node_or_None)
    version, by_node = puller.pull_latest(out=dict(engine.model.named_parameters()))

Which piece comes from where is the puller's copy plan (cluster/placement.SlotPlacement.pull_plan):
one piece per row range, this node's own where it holds one (``local``: this node's Parameter
Server, read from shared memory / CUDA IPC), the others from their owners on other nodes. Requests
and answers travel on small CURVE ZeroMQ sockets (net/curve.py); the bytes go through
torch.distributed point-to-point on a group made at start-up for each remote puller (the owners it
pulls from + itself): gloo over TCP on CPU, NCCL on GPUs (so GPU weights go device to device). A
pull, like a local one, is versioned and never torn:
  1. the version v to read is the newest one every node involved has published (they publish
     within one trainer barrier of each other, and each keeps the previous version in its other slot);
  2. this node's pieces are copied under their slot's shared lock (``SlotReader.read_local``);
  3. every remote owner in the plan is asked for v: each takes its slot's shared lock (its own file
     descriptor, so the trainer's exclusive claim of the slot waits for it), checks that the slot
     still holds v, answers ok, sends its piece's rows of every parameter in layout order, waits for
     the sends, checks the seqlock stamp again and says whether the copy was clean;
  4. the puller receives each row block into a staging buffer and copies it into ``out`` (any
     strides, cast on its device); a piece that is gone (v overwritten meanwhile) or torn makes it
     start again at 1 with the newest version.
On CPU each trainer node holds one piece (served by its first trainer rank); on GPUs one per trainer
rank, each sent by the rank whose GPU holds it (no process maps another trainer's GPU).
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading

import msgspec
import torch
import torch.distributed as dist
import zmq

from staleflow.net.curve import incoming, user_rank
from staleflow.servers.errors import ServerError
from staleflow.servers.layout import ParamLayout, PieceSpec, dtype_of
from staleflow.servers.segment import segment_path
from staleflow.servers.slot import PUBLISHED, read_clean
from staleflow.servers.transport import sync_device


class WeightRequest(msgspec.Struct, tag=True, array_like=True):
    version: int
    """-1: only say which version is the newest (no bytes)."""
    want_layout: bool = False


class WeightOffer(msgspec.Struct, tag=True, array_like=True):
    version: int
    ok: bool
    pieces: int = 1
    layout: bytes = b""
    error: str = ""


class WeightDone(msgspec.Struct, tag=True, array_like=True):
    version: int
    clean: bool


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(WeightRequest | WeightOffer | WeightDone).decode


class WeightServer:
    """A piece owner's server thread: answers WeightRequests and sends its piece of a version."""

    def __init__(self, ps, piece: int, sock: zmq.Socket, groups: dict[int, object], device: torch.device):
        self.ps, self.piece, self.sock, self.groups, self.device = ps, piece, sock, groups, torch.device(device)
        # Our own descriptors: a flock on the main thread's fd would merely convert its lock.
        self._lock_fds = [os.open(segment_path(sl.seg.name), os.O_RDWR | os.O_NOFOLLOW) for sl in ps.slots]
        self.served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="staleflow-weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: NCCL sends from this piece's GPU
        for frames in incoming(self.sock, self._stop):
            try:
                if len(frames) != 2:
                    raise ServerError(f"{len(frames)} frames")
                who, req = user_rank(frames[1]), _decode(frames[1].bytes)
                if who not in self.groups or not isinstance(req, WeightRequest):
                    raise ServerError(f"a {type(req).__name__} from rank {who}, which does not pull from here")
                self._serve(frames[0].bytes, who, req)
            except Exception as e:  # a bad request or a puller that died mid-transfer: log, keep serving
                print(
                    f"staleflow: weight server (piece {self.piece}): {type(e).__name__}: {str(e)[:300]}",
                    file=sys.stderr,
                    flush=True,
                )

    def _reply(self, ident: bytes, msg) -> None:
        self.sock.send_multipart([ident, _encode(msg)])

    def _serve(self, ident: bytes, who: int, req: WeightRequest) -> None:
        ps = self.ps
        if req.version < 0:
            v = ps.latest_version()
            self._reply(
                ident,
                WeightOffer(
                    -1 if v is None else v, v is not None, ps.pieces, ps.layout.encode() if req.want_layout else b""
                ),
            )
            return
        idx = next((i for i, sl in enumerate(ps.slots) if sl.header()[:2] == (PUBLISHED, req.version)), None)
        if idx is None:
            self._reply(ident, WeightOffer(req.version, False, ps.pieces, error="overwritten"))
            return
        sl, fd = ps.slots[idx], self._lock_fds[idx]
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            before = sl.header()
            if before[0] != PUBLISHED or before[1] != req.version or before[2] & 1:
                self._reply(ident, WeightOffer(req.version, False, ps.pieces, error="overwritten"))
                return
            self._reply(ident, WeightOffer(req.version, True, ps.pieces))
            group = self.groups[who]
            spec = ps.table[self.piece]
            for e in ps.layout.entries:
                a, b = spec.rows(e.shape)
                if b > a:
                    dist.send(sl.views[self.piece][e.name].reshape(-1), dst=who, group=group)
            sync_device(self.device)
            clean = sl.header() == before
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self.served += 1
        self._reply(ident, WeightDone(req.version, clean))

    def close(self) -> None:
        if not self._lock_fds:
            return
        self._stop.set()
        self._thread.join(timeout=30)
        self.sock.close(linger=0)
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []


class RemoteWeights:
    """A rollout rank's pulls of the pieces other nodes hold (and of its own node's, ``local``)."""

    def __init__(
        self,
        socks: dict[int, zmq.Socket],
        table: tuple[PieceSpec, ...],
        group,
        device: str | torch.device,
        local=None,
        timeout_s: float = 300.0,
    ):
        """``socks``: piece -> the weight server of its owner, for every piece of the plan held on
        another node; ``table``: the run's pieces (cluster/placement.py); ``local``: this node's
        ParameterServer (attached as a reader) when it holds the plan's other pieces, else None."""
        self.socks, self.table, self.group, self.local = dict(socks), tuple(table), group, local
        self.device, self.timeout_ms = torch.device(device), int(timeout_s * 1000)
        self.layout: ParamLayout | None = local.layout if local is not None else None
        self.pieces = len(self.table)
        self._staging = torch.empty(0, dtype=torch.uint8, device=self.device)
        first: dict[int, int] = {}
        for p in sorted(self.socks):
            first.setdefault(self.table[p].node, p)
        self._ask_nodes = list(first.values())  # one piece per remote node answers "which version?"

    def _owner(self, p: int) -> int:
        return self.table[p].owner

    def _ask(self, p: int, req: WeightRequest):
        self.socks[p].send(_encode(req))
        return self._answer(p)

    def _answer(self, p: int):
        if not self.socks[p].poll(self.timeout_ms):
            raise ServerError(
                f"the weight server of rank {self._owner(p)} (Parameter Server piece {p}, node {self.table[p].node}) "
                f"did not answer within {self.timeout_ms // 1000} s: is its node reachable?"
            )
        return _decode(self.socks[p].recv())

    def latest_version(self) -> int | None:
        """The newest version every node of the plan has published (None before the first)."""
        versions = [self.local.latest_version()] if self.local is not None else []
        for p in self._ask_nodes:
            offer = self._ask(p, WeightRequest(-1, want_layout=self.layout is None))
            if self.layout is None and offer.layout:
                self.layout = ParamLayout.decode(offer.layout)
            if offer.pieces != self.pieces:
                raise ServerError(
                    f"the Parameter Server of node {self.table[p].node} has {offer.pieces} pieces, this rank's "
                    f"placement {self.pieces}: is every node running the same StaleFlow and flags?"
                )
            versions.append(offer.version if offer.ok else None)
        return None if any(v is None for v in versions) else min(versions)

    def _receive(self, p: int, out: dict[str, torch.Tensor] | None) -> int:
        """Piece p's rows of every parameter, into ``out`` (None: received and dropped)."""
        n = 0
        spec = self.table[p]
        for e in self.layout.entries:
            a, b = spec.rows(e.shape)
            if b <= a:
                continue
            shape = (b - a, *e.shape[1:]) if e.shape else ()
            dtype = dtype_of(e.dtype)
            numel = (b - a) * (e.numel // (e.shape[0] if e.shape else 1))
            nbytes = numel * dtype.itemsize
            if self._staging.numel() < nbytes:
                self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            buf = self._staging[:nbytes].view(dtype)
            dist.recv(buf, src=self._owner(p), group=self.group)
            if out is not None:
                dst = out[e.name]
                (dst if dst.dim() == 0 else dst[a:b]).copy_(buf.view(shape))
            n += nbytes
        return n

    @torch.no_grad()
    def pull_latest(self, out: dict[str, torch.Tensor], retries: int = 3) -> tuple[int, dict[int, int]]:
        """Copy the newest version every node holds into ``out`` in place; returns (version, bytes of the
        successful copy by the node that held them: this node's for the local pieces)."""
        got: dict[int, int] = {}

        def read(version: int) -> bool | None:
            self._check(out)
            got.clear()
            local = True
            if self.local is not None:
                local = self.local.read_local(version, out)
                if local is not None:
                    got[self.local.node] = sum(self.layout.piece_bytes(self.table[p]) for p in self.local.local)
            remote = sorted(self.socks)
            for p in remote:
                self.socks[p].send(_encode(WeightRequest(version)))
            offers = {p: self._answer(p) for p in remote}
            complete = local is not None and all(o.ok for o in offers.values())
            for p, offer in offers.items():
                if offer.ok:  # an owner that offered sends its rows anyway: receive (and drop) them
                    n = self._receive(p, out if complete else None)
                    got[self.table[p].node] = got.get(self.table[p].node, 0) + n
            clean = all(self._answer(p).clean for p, o in offers.items() if o.ok) and bool(local)
            sync_device(self.device)
            return clean if complete else None

        version = read_clean(read, self.latest_version, retries + 1, "pull_latest from another node")
        return version, dict(got)

    def _check(self, out: dict[str, torch.Tensor]) -> None:
        index = self.layout.index()
        missing = [n for n in index if n not in out]
        bad = [n for n, t in out.items() if n not in index or tuple(t.shape) != index[n].shape]
        if missing or bad:
            raise KeyError(
                f"pull(out=...): names or shapes differ from the Parameter Server's layout (missing "
                f"{missing[:3]}, unknown or reshaped {bad[:3]})"
            )

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)
        if self.local is not None:
            self.local.close()
            self.local = None
