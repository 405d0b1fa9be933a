"""Weights across nodes on CPU: a Parameter Server owner keeps publishing versions while a puller of
another 'node' pulls over gloo (two real processes, CURVE sockets for the requests). Every pull
must be one whole published version, bit-exact, also into strided destinations, and versions
never go backwards."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from staleflow.servers import ParameterServer, ParamLayout
from staleflow.servers.layout import equal_pieces
from staleflow.servers.remote_weights import RemoteWeights, WeightServer

pytestmark = pytest.mark.slow

SPECS = [
    ("embed", (300, 16), "float32"),
    ("norm", (16,), "bfloat16"),
    ("scale", (), "float32"),
    ("proj", (16, 40), "float32"),
]
VERSIONS = 30


def value(name: str, shape, dtype: torch.dtype, version: int) -> torch.Tensor:
    n = max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
    base = (torch.arange(n, dtype=torch.float32) % 97 + 1000 * version + 7 * len(name)).reshape(shape)
    return base.to(dtype)


def _rank(rank: int, store_file: str, run_id: str, secret: bytes, result_file: str) -> None:
    from staleflow.net.curve import RunKeys, SecureContext

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    keys = RunKeys(secret, 2)
    layout = ParamLayout.from_specs(SPECS)
    dtypes = {n: getattr(torch, d) for n, _, d in SPECS}
    if rank == 0:
        ps = ParameterServer.create(run_id, layout)
        secure = SecureContext(keys, "rank 0", 0)
        sock, endpoint = secure.server(zmq.ROUTER, "127.0.0.1", b"weights")
        server = WeightServer(ps, 0, sock, {1: group}, "cpu")
        obj = [endpoint]
        for v in range(VERSIONS):
            ps.begin_push(v)
            for name, shape, _ in SPECS:
                ps.write_shard(name, value(name, shape, dtypes[name], v))
            ps.end_push()
            ps.publish(v)
            if v == 0:
                dist.broadcast_object_list(obj, src=0)
            time.sleep(0.03)  # a training step: pulls interleave with pushes
        dist.barrier()
        served = server.served
        server.close()
        ps.close()
        secure.close()
        assert served > 0
    else:
        obj = [None]
        dist.broadcast_object_list(obj, src=0)
        secure = SecureContext(keys, "rank 1", 1)
        puller = RemoteWeights({0: secure.client(zmq.DEALER, obj[0])}, equal_pieces(1), group, "cpu")
        embed_t = torch.zeros(16, 300).t()  # a strided destination, like an engine's transposed weight
        out = {
            "embed": embed_t,
            "norm": torch.zeros(16, dtype=torch.bfloat16),
            "scale": torch.zeros(()),
            "proj": torch.zeros(16, 40),
        }
        seen = []
        while not seen or seen[-1] < VERSIONS - 1:
            v, by_node = puller.pull_latest(out)
            assert by_node == {0: sum(t.numel() * t.element_size() for t in out.values())}
            for name, shape, _ in SPECS:
                assert torch.equal(out[name], value(name, shape, dtypes[name], v)), f"{name} is not version {v}"
            seen.append(v)
        assert seen == sorted(seen)
        with open(result_file, "w") as f:
            f.write(",".join(map(str, seen)))
        puller.close()
        secure.close()
        dist.barrier()
    dist.destroy_process_group()


def test_multinode_remote_pulls_over_gloo_are_whole_versions_while_the_owner_publishes(tmp_path):
    from staleflow.net.curve import new_secret

    result, run_id = tmp_path / "seen.txt", uuid.uuid4().hex[:10]
    mp.spawn(_rank, args=(str(tmp_path / "store"), run_id, new_secret(), str(result)), nprocs=2, join=True)
    seen = [int(v) for v in result.read_text().split(",")]
    assert seen[-1] == VERSIONS - 1 and len(seen) >= 2
    assert not [f for f in os.listdir("/dev/shm") if run_id in f]  # the slots are gone with their owner
