"""Rank set-up in one place: torchrun's environment -> identity, device, process groups.

    env = read_env()                         # RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK
    device = pick_device(env.local_rank)     # cuda:LOCAL_RANK when CUDA is there, else cpu
    set_device(device)                       # before any CUDA work: every later allocation lands there
    init_world(roles.world_size, env.rank)   # gloo world group (control collectives only)
    topo = gather_topology(...)              # cluster/topology.py: every rank's node
    trainer_group, pull_groups, replicas = run_groups(topo, device)

Start-up data crosses ranks as JSON in tensors (cluster/exchange.py: ``broadcast_json`` /
``all_gather_json``), never pickled. Node identity comes from torchrun (GROUP_RANK / LOCAL_RANK),
never from the hostname. The trainer group is NCCL on GPUs, gloo on CPUs; so is the group of each rollout rank that pulls
weights from another node (the piece owners it pulls from + that rank), and with --cluster.sharding hsdp
across nodes the trainer's shard groups (a node's trainer ranks) and replicate groups (one rank of each).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from staleflow.config import ConfigError


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int


def read_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    env = os.environ if environ is None else environ
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except KeyError:
        raise ConfigError(
            "staleflow train must run under torchrun (RANK/WORLD_SIZE are not set): use ./launch.sh or "
            "torchrun --standalone --nproc_per_node=3 -m staleflow train"
        ) from None
    local = int(env.get("LOCAL_RANK", rank))
    return RankEnv(
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
        node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
    )


def pick_device(local_rank: int, cuda_count: int | None = None) -> str:
    """cuda:LOCAL_RANK on a GPU node, cpu otherwise.

    More local ranks than GPUs (e.g. 1 trainer + 1 rollout rank on a one-GPU machine) share GPUs
    round-robin; that works for rollout ranks and a single trainer rank, not for two NCCL trainer
    ranks on one GPU."""
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_count <= 0:
        return "cpu"
    return f"cuda:{local_rank % cuda_count}"


def set_device(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)


def _timeout():
    from datetime import timedelta

    # A bounded wait: a collective whose peer died fails in minutes, never hangs for gloo's 30.
    return timedelta(seconds=float(os.environ.get("STALEFLOW_COLLECTIVE_TIMEOUT_S", "600")))


def init_world(world_size: int, rank: int) -> None:
    """Join the world process group (gloo: control collectives only)."""
    import torch.distributed as dist

    timeout = _timeout()
    dist.init_process_group(
        "gloo", store=_attempt_store(rank, world_size, timeout), rank=rank, world_size=world_size, timeout=timeout
    )


def make_groups(roles, device: str, pull_owners: dict[int, list[int]] | None = None, trainer_rows=None):
    """The trainer group; one group per rollout rank that pulls weights over the network
    (``pull_owners``: that rank -> the piece owners on other nodes it pulls from; the group is them +
    the rank); with ``trainer_rows`` (HSDP: the trainer ranks of each trainer node) a shard group per
    row and a replicate group per column. Every rank calls this, in the same order (new_group is
    collective over the world). Returns (trainer group, {puller rank: group}, Replicas or None)."""
    import torch.distributed as dist

    timeout = _timeout()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and roles.num_trainer > 1 and _shared_gpus(roles):
        print(
            "staleflow: warning: more trainer ranks than GPUs; NCCL cannot put two ranks on one GPU",
            file=sys.stderr,
            flush=True,
        )
    trainer_group = dist.new_group(roles.trainer_ranks, backend=backend, timeout=timeout)
    pulls = {
        r: dist.new_group(sorted({*owners, r}), backend=backend, timeout=timeout)
        for r, owners in sorted((pull_owners or {}).items())
    }
    replicas = None
    if trainer_rows:
        from staleflow.train.parallelize import Replicas

        me = dist.get_rank()
        rows = tuple(tuple(row) for row in trainer_rows)
        shard = [dist.new_group(list(row), backend=backend, timeout=timeout) for row in rows]
        columns = [dist.new_group(list(col), backend=backend, timeout=timeout) for col in zip(*rows)]
        mine = [(i, row.index(me)) for i, row in enumerate(rows) if me in row]
        if mine:
            i, s = mine[0]
            replicas = Replicas(rows, shard[i], columns[s])
    return trainer_group, pulls, replicas


def run_groups(topo, device: str):
    """``make_groups`` for a run laid out as ``topo``: each rollout rank's remote piece owners from the
    Parameter Server's placement (cluster/placement.py), the HSDP rows when the trainer spans nodes
    with --cluster.sharding hsdp. Returns (trainer group, {puller rank: group}, Replicas or None)."""
    from staleflow.cluster.placement import slot_placement

    place = slot_placement(topo, device.split(":")[0])
    pulls = {r: place.remote_owners(topo.node_of(r), r) for r in topo.roles.rollout_ranks}
    nodes = topo.trainer_nodes
    rows = [topo.trainers_on(n) for n in nodes] if topo.replicated and len(nodes) > 1 else None
    return make_groups(topo.roles, device, {r: o for r, o in pulls.items() if o}, rows)


def init_groups(roles, rank: int, device: str):
    """Join the world (gloo) and build the trainer group (NCCL on CUDA); returns the trainer group."""
    init_world(roles.world_size, rank)
    return make_groups(roles, device)[0]


def _attempt_store(rank: int, world_size: int, timeout):
    """torchrun's bootstrap store, under a prefix per elastic attempt.

    torchrun's c10d rendezvous keeps one shared TCPStore across restarts, so the keys of the
    previous attempt's process groups (peer addresses) are still there and a restarted rank
    would connect to dead peers. A prefix with TORCHELASTIC_RESTART_COUNT isolates attempts."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=(not agent and rank == 0),
        timeout=timeout,
        multi_tenant=not agent,
    )
    return dist.PrefixStore(f"/staleflow/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _shared_gpus(roles) -> bool:
    import torch

    return torch.cuda.device_count() < roles.num_trainer
