"""Weights across nodes: the Parameter Server's piece owners serve published versions to the
rollout ranks of other nodes, each of which pulls on its own schedule.

    server = WeightServer(ps, piece, sock, groups, device)        # a thread on each piece owner
    puller = RemoteWeights(socks, owners, group, device)         # a rollout rank off the PS's node
    version, nbytes = puller.pull_latest(out=dict(engine.model.named_parameters()))

Requests and answers travel on small CURVE ZeroMQ sockets (net/curve.py); the bytes go through
torch.distributed point-to-point on a group made at start-up for each remote puller (its piece
owners + itself): gloo over TCP on CPU, NCCL on GPUs (so GPU weights go device to device). A
pull, like a local one, is versioned and never torn:
  1. ask owner 0 for the newest published version v (and, once, the layout and piece count);
  2. ask every owner for v: each takes its slot's shared lock (its own file descriptor, so the
     trainer's exclusive claim of the slot waits for it), checks that the slot still holds v,
     answers ok, sends its piece's rows of every parameter in layout order, waits for the sends,
     checks the seqlock stamp again and says whether the copy was clean;
  3. the puller receives each row block into a staging buffer and copies it into ``out`` (any
     strides, cast on its device); a piece that is gone (v overwritten meanwhile) or torn makes it
     start again at 1 with the newest version.
On CPU a slot has one piece (owner: the trainer leader); on GPUs one per trainer rank, each sent by
the rank whose GPU holds it (no process maps another trainer's GPU). Same-node pullers keep the
shared-memory / CUDA IPC path (parameter.py); only ranks off the PS's node use this.
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
from staleflow.servers.layout import ParamLayout, dtype_of, piece_rows
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
            for e in ps.layout.entries:
                a, b = piece_rows(e.shape, ps.pieces, self.piece)
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
    """A rollout rank's pulls from the piece owners on the Parameter Server's node."""

    def __init__(
        self, socks: list[zmq.Socket], owners: list[int], group, device: str | torch.device, timeout_s: float = 300.0
    ):
        self.socks, self.owners, self.group = socks, owners, group  # socks[p]: owner p's weight server
        self.device, self.timeout_ms = torch.device(device), int(timeout_s * 1000)
        self.layout: ParamLayout | None = None
        self.pieces = len(owners)
        self._staging = torch.empty(0, dtype=torch.uint8, device=self.device)

    def _ask(self, p: int, req: WeightRequest):
        self.socks[p].send(_encode(req))
        return self._answer(p)

    def _answer(self, p: int):
        if not self.socks[p].poll(self.timeout_ms):
            raise ServerError(
                f"the weight server of rank {self.owners[p]} (Parameter Server piece {p}) did not "
                f"answer within {self.timeout_ms // 1000} s: is its node reachable?"
            )
        return _decode(self.socks[p].recv())

    def latest_version(self) -> int | None:
        offer = self._ask(0, WeightRequest(-1, want_layout=self.layout is None))
        if self.layout is None and offer.layout:
            self.layout, self.pieces = ParamLayout.decode(offer.layout), offer.pieces
            if self.pieces != len(self.owners):
                raise ServerError(
                    f"the Parameter Server has {self.pieces} pieces but {len(self.owners)} owners serve it"
                )
        return offer.version if offer.ok else None

    def _receive(self, p: int, out: dict[str, torch.Tensor] | None) -> int:
        """Piece p's rows of every parameter, into ``out`` (None: received and dropped)."""
        n = 0
        for e in self.layout.entries:
            a, b = piece_rows(e.shape, self.pieces, p)
            if b <= a:
                continue
            shape = (b - a, *e.shape[1:]) if e.shape else ()
            dtype = dtype_of(e.dtype)
            numel = (b - a) * (e.numel // (e.shape[0] if e.shape else 1))
            nbytes = numel * dtype.itemsize
            if self._staging.numel() < nbytes:
                self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            buf = self._staging[:nbytes].view(dtype)
            dist.recv(buf, src=self.owners[p], group=self.group)
            if out is not None:
                dst = out[e.name]
                (dst if dst.dim() == 0 else dst[a:b]).copy_(buf.view(shape))
            n += nbytes
        return n

    @torch.no_grad()
    def pull_latest(self, out: dict[str, torch.Tensor], retries: int = 3) -> tuple[int, int]:
        """Copy the newest published version into ``out`` in place; returns (version, bytes received)."""
        got = {"bytes": 0}

        def read(version: int) -> bool | None:
            self._check(out)
            for sock in self.socks:
                sock.send(_encode(WeightRequest(version)))
            offers = [self._answer(p) for p in range(self.pieces)]
            complete = all(o.ok for o in offers)
            for p, offer in enumerate(offers):
                if offer.ok:  # an owner that offered sends its rows anyway: receive (and drop) them
                    got["bytes"] += self._receive(p, out if complete else None)
            clean = all(self._answer(p).clean for p, o in enumerate(offers) if o.ok)
            sync_device(self.device)
            return clean if complete else None

        version = read_clean(read, self.latest_version, retries + 1, "pull_latest from another node")
        return version, got["bytes"]

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
        for s in self.socks:
            s.close(linger=0)
