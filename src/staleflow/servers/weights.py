"""Where a rollout instance gets its weights: one WeightSource, chosen once at start-up.

    source = open_weight_source(run_id, backend, reader=2, worker_reader=5, remote=None)   # engines.EngineBackend
    version, nbytes, by_node = source.load(engine, keep_kv=False)    # a Pull; by_node: bytes per source node
    source.close()

Three transports sit behind the one interface; the rollout worker never asks which:

- ``LocalWeights``: the Parameter Server on this node, holding every piece (CPU shared memory, or
  GPU pieces mapped by CUDA IPC onto the engine's own GPU), copied straight into the engine's parameters
  (``engine.weight_targets()``), no staging copy: the slot layout equals the engine's (fused groups
  adjacent, every parameter contiguous), so each fused matrix of a one-piece slot arrives in one
  contiguous copy (servers/copy_plan.py), issued on the engine GPU's stream;
- ``RemoteSource``: pieces on other nodes (and this node's, where it holds some); their owners send
  the bytes (servers/remote_weights.py) into the engine's parameters, or into staging tensors for an engine
  that has none to offer (one running in another process), which then loads them with
  ``engine.load_weights``;
- ``EngineLoadsItself``: an engine whose own worker process maps the Parameter Server (its own
  reader index) and reloads from the slot's views (``engine.load_from_server``).
On the home node, when it holds every piece, the engine's backend (staleflow.engines) chooses between
the first and the last; another node holding every piece (HSDP) reads its own with ``LocalWeights``.

Each reads a version clean or not at all: every transport goes through the one torn-read retry
loop (``slot.read_clean``). ``load`` returns (version, bytes moved, bytes by the node that held them).
"""

from __future__ import annotations

from typing import Protocol

import torch

from staleflow.servers.parameter import ParameterServer


class WeightSource(Protocol):
    """What a rollout worker pulls from."""

    def load(self, engine, keep_kv: bool) -> tuple[int, int, dict[int, int]]:
        """Load the newest published version into ``engine``; (version, bytes, {source node: bytes})."""

    def close(self) -> None: ...


class LocalWeights:
    """``node``'s Parameter Server (this rank's node, holding every piece), read as reader index
    ``reader`` (attached on the first pull)."""

    def __init__(self, run_id: str, reader: int, timeout: float = 60.0, node: int = 0):
        self.run_id, self.reader, self.timeout, self.node = run_id, reader, timeout, node
        self.ps: ParameterServer | None = None

    def load(self, engine, keep_kv: bool) -> tuple[int, int, dict[int, int]]:
        targets = engine.weight_targets()
        if self.ps is None:  # GPU pieces mapped on the engine's GPU: the copies run there, not on the trainers'
            device = next(iter(targets.values())).device
            self.ps = ParameterServer.attach(
                self.run_id,
                timeout=self.timeout,
                reader=self.reader,
                device=device if device.type == "cuda" else None,
                node=self.node,
            )
        targets, strict = slot_targets(targets, self.ps.layout)
        version, _ = self.ps.pull_latest(out=targets)
        # validates and stamps; copying onto itself is free
        engine.load_weights(targets, version, keep_kv=keep_kv, **({} if strict else {"strict": False}))
        return version, self.ps.layout.nbytes, {self.node: self.ps.layout.nbytes}

    def close(self) -> None:
        if self.ps is not None:
            self.ps.close()
            self.ps = None


def slot_targets(targets: dict[str, torch.Tensor], layout) -> tuple[dict[str, torch.Tensor], bool]:
    """The engine parameters a slot of ``layout`` fills, and whether that is all of them. A LoRA run's
    slots hold only the adapted projections' merged weights (train/lora.py): the rest of the engine's
    parameters keep what the rank loaded from --model.path, which never changes in such a run."""
    names = layout.names()
    if len(names) == len(targets):
        return targets, True
    missing = [n for n in names if n not in targets]
    if missing:
        raise KeyError(f"the Parameter Server holds {missing[:3]}, which the engine does not have")
    return {n: targets[n] for n in names}, False


class RemoteSource:
    """Pieces held on other nodes, through their owners, and this node's own (RemoteWeights)."""

    def __init__(self, remote):
        self.remote = remote
        self._staging: dict[str, torch.Tensor] | None = None

    def load(self, engine, keep_kv: bool) -> tuple[int, int, dict[int, int]]:
        targets = engine.weight_targets()
        strict = True
        if targets is None:  # the engine holds its weights in another process: receive, then hand over
            if self.remote.layout is None:
                self.remote.latest_version()  # learns the layout
            if self._staging is None:
                self._staging = self.remote.layout.empty(self.remote.device)
            targets = self._staging
        else:
            if self.remote.layout is None:
                self.remote.latest_version()
            targets, strict = slot_targets(targets, self.remote.layout)
        version, by_node = self.remote.pull_latest(out=targets)
        engine.load_weights(targets, version, keep_kv=keep_kv, **({} if strict else {"strict": False}))
        return version, sum(by_node.values()), by_node

    def close(self) -> None:
        self._staging = None


class EngineLoadsItself:
    """An engine whose worker process maps this node's Parameter Server with its own reader index."""

    def __init__(self, run_id: str, worker_reader: int):
        self.run_id, self.worker_reader = run_id, worker_reader
        self.nbytes = 0

    def load(self, engine, keep_kv: bool) -> tuple[int, int, dict[int, int]]:
        version = engine.load_from_server(self.run_id, self.worker_reader, keep_kv=keep_kv)
        if not self.nbytes:  # the slot headers only (versions and layout), never the weights
            ps = ParameterServer.attach(self.run_id, timeout=60.0)
            self.nbytes = ps.layout.nbytes
            ps.close()
        return version, self.nbytes, {0: self.nbytes}

    def close(self) -> None:
        pass


def open_weight_source(
    run_id: str, backend, reader: int, worker_reader: int, remote=None, node: int = 0, home: int = 0
) -> WeightSource:
    """The one weight source of a rollout rank on ``node``: remote when some pieces are on another node
    (``remote``: its RemoteWeights), a local reader of ``node``'s server when that node (not the home
    node) holds every piece (HSDP), else the one the engine's backend chooses (staleflow.engines:
    ``backend.weight_source``; by default a local reader, ``reader``: cluster.placement.reader_index,
    or the engine's own loader, whose worker process reads as ``worker_reader``: the engines that need
    the home node refuse other placements at start, ``check_placement``)."""
    if remote is not None:
        return RemoteSource(remote)
    if node != home:
        return LocalWeights(run_id, reader, node=node)
    return backend.weight_source(run_id, reader, worker_reader)
