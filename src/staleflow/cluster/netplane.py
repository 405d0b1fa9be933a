"""A rank's cross-node plane in a multi-node run: its TCP servers and clients, set up once.

    net = NetPlane.open(topo, rank, run_id, secret, pull_groups, device)   # every rank (a collective)
    ControlClient(endpoint, rank, secure=net.secure)   # a rank off the controller's node (control/)
    net.shipper / net.record_server / net.fetcher  # a rollout rank (what its node needs)
    net.start_receiver(); net.ring_reader(r)       # trainer ranks (and the controller: servers.mirror)
    net.start_weight_server(ps); net.remote_weights()
    net.close()

``open`` binds the servers this rank hosts (on its node's address, behind the CURVE gatekeeper)
and gathers every rank's endpoints over the world group, so each client knows where to connect
before any worker starts. What a rank hosts follows from the topology (cluster/topology.py) and the
Parameter Server's placement (cluster/placement.py):
  record receiver  the first trainer rank of a trainer node that rollout ranks ship to;
  weight server    each Parameter Server piece owner whose piece some rollout rank of another node
                   pulls (its copy plan);
  record server    every rollout rank, when rollout ranks span nodes (partial records on request).
A single-node run has no NetPlane: nothing here runs, nothing listens on TCP.
"""

from __future__ import annotations

import torch
import zmq

from staleflow.cluster.exchange import all_gather_json
from staleflow.cluster.placement import reader_index, slot_placement
from staleflow.cluster.topology import Topology
from staleflow.net.curve import RunKeys, SecureContext
from staleflow.servers.mirror import attach_mirror
from staleflow.servers.remote_weights import RemoteWeights, WeightServer
from staleflow.servers.ring import align_up
from staleflow.servers.shipping import RecordFetcher, RecordReceiver, RecordServer, RecordShipper, ZeroCopySends
from staleflow.servers.trajectory import DEFAULT_RING_BYTES, TrajectoryRing


class NetPlane:
    def __init__(self, topo: Topology, rank: int, run_id: str, secure: SecureContext, pull_groups: dict, device: str):
        self.topo, self.rank, self.run_id, self.secure = topo, rank, run_id, secure
        self.pull_groups, self.device = pull_groups, torch.device(device)
        self.node = topo.node_of(rank)
        self.place = slot_placement(topo, self.device.type)
        self.endpoints: list[dict] = []
        self._bound: dict[str, zmq.Socket] = {}
        self.sends = ZeroCopySends()
        self.receiver: RecordReceiver | None = None
        self.weight_server: WeightServer | None = None
        self.shipper: RecordShipper | None = None
        self.record_server: RecordServer | None = None
        self.fetcher: RecordFetcher | None = None
        self._closers: list = []

    @classmethod
    def open(cls, topo: Topology, rank: int, run_id: str, secret: bytes, pull_groups: dict, device: str) -> NetPlane:
        """Bind this rank's servers and gather every rank's endpoints (all ranks call it together)."""
        roles = topo.roles
        secure = SecureContext(RunKeys(secret, roles.world_size), f"rank {rank}", rank)
        net = cls(topo, rank, run_id, secure, pull_groups, device)
        ip = topo.addrs[net.node]
        mine = {}
        if rank == topo.receiver_rank(net.node) and net.shipping_ranks():
            net._bound["records"], mine["records"] = secure.server(zmq.PULL, ip, b"records")
        if net.pullers_of(rank):
            net._bound["weights"], mine["weights"] = secure.server(zmq.ROUTER, ip, b"weights")
        if roles.role(rank) == "rollout" and topo.fetches_partials:
            net._bound["fetch"], mine["fetch"] = secure.server(zmq.ROUTER, ip, b"fetch")
        net.endpoints = all_gather_json(mine)
        if roles.role(rank) == "rollout":
            net._rollout_side()
        return net

    def pullers_of(self, owner: int) -> list[int]:
        """Rollout ranks of other nodes whose copy plan pulls a piece of ``owner`` over the network."""
        topo = self.topo
        return [r for r in topo.roles.rollout_ranks if owner in self.place.remote_owners(topo.node_of(r), r)]

    def shipping_ranks(self) -> list[int]:
        """Rollout ranks that ship their finished records to this rank's node."""
        return [r for r in self.topo.roles.rollout_ranks if self.node in self.topo.ships_to(r)]

    # ---- rollout ranks ------------------------------------------------------------------------
    def _rollout_side(self) -> None:
        topo = self.topo
        dests = topo.ships_to(self.rank)
        if dests:
            socks = {}
            for node in dests:
                sock = self.secure.client(zmq.PUSH, self.endpoints[topo.receiver_rank(node)]["records"])
                sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the ring: zero-copy sends hold no extra memory
                socks[node] = sock
            self.shipper = RecordShipper(socks, self.sends)
            self._closers.append(self.shipper.close)
        if "fetch" in self._bound:
            self.record_server = RecordServer(self._bound.pop("fetch"), self.sends)
            self._closers.append(self.record_server.close)
            self.fetcher = RecordFetcher(lambda r: self.secure.client(zmq.DEALER, self.endpoints[r]["fetch"]))
            self._closers.append(self.fetcher.close)

    def remote_weights(self, timeout: float = 300.0) -> RemoteWeights | None:
        """The puller of a rollout rank whose copy plan takes some pieces from other nodes (None when its
        node holds every piece); this node's own pieces, if any, it reads from this node's Parameter
        Server (waiting up to ``timeout`` for its trainer ranks to create it)."""
        place, node = self.place, self.node
        remote = [p for p in place.pull_plan(node, self.rank) if place.pieces[p].node != node]
        if not remote:
            return None
        socks = {p: self.secure.client(zmq.DEALER, self.endpoints[place.owner(p)]["weights"]) for p in remote}
        local = None
        if place.on_node(node):
            from staleflow.servers.parameter import ParameterServer

            cuda = self.device.type == "cuda"
            local = ParameterServer.attach(
                self.run_id,
                timeout=timeout,
                reader=reader_index(self.rank, self.topo.roles.world_size),
                device=self.device if cuda else None,
                node=node,
            )
        puller = RemoteWeights(socks, place.pieces, self.pull_groups[self.rank], self.device, local=local)
        self._closers.append(puller.close)
        return puller

    def fetches_from(self, producer: int) -> bool:
        """A partial record of ``producer`` must come over the network (it lives on another node)."""
        return not self.topo.same_node(producer, self.rank)

    # ---- trainer ranks ------------------------------------------------------------------------
    def start_receiver(self) -> None:
        """This node's record receiver (the node's first trainer rank), mirrors made before Ready."""
        if "records" in self._bound:
            self.receiver = RecordReceiver(
                self._bound.pop("records"), self.run_id, self.node, self.shipping_ranks(), align_up(DEFAULT_RING_BYTES)
            )
            self._closers.append(self.receiver.close)

    def start_weight_server(self, ps) -> None:
        """Serve this rank's piece to the rollout ranks of other nodes whose plan pulls it from here."""
        if "weights" in self._bound:
            piece = next(p for p, spec in enumerate(self.place.pieces) if spec.owner == self.rank)
            groups = {r: self.pull_groups[r] for r in self.pullers_of(self.rank)}
            self.weight_server = WeightServer(ps, piece, self._bound.pop("weights"), groups, self.device)
            self._closers.insert(0, self.weight_server.close)

    def ring_reader(self, producer: int, timeout: float = 30.0) -> tuple[TrajectoryRing, bool]:
        """(ring to read ``producer``'s records from, whether it is this node's mirror of it)."""
        if self.topo.same_node(producer, self.rank):
            return TrajectoryRing.attach(self.run_id, producer, timeout=timeout), False
        return attach_mirror(self.run_id, producer, self.node, timeout=timeout), True

    # ---- all ----------------------------------------------------------------------------------
    def close(self) -> None:
        for close in self._closers:
            close()
        for sock in self._bound.values():
            sock.close(linger=0)
        self.secure.close()
