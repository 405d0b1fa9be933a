"""Start-up data exchanged between ranks as JSON in uint8 tensors, never pickled.

    shared = broadcast_json(shared, src=0)     # rank 0's run id, config, secret on every rank
    nodes = all_gather_json([node, local, ip])  # every rank's entry, in rank order

torch's ``broadcast_object_list`` / ``all_gather_object`` pickle: any host that can reach the
group's sockets could then run code in every rank. Here the bytes are only parsed as JSON.
"""

from __future__ import annotations

import json


def broadcast_json(obj, src: int = 0, group=None):
    """``obj`` (JSON-able, given on rank ``src``) on every rank of ``group`` (default: the gloo world).

    The bytes travel in uint8 tensors and are parsed as JSON: torch's ``broadcast_object_list``
    pickles, so any host that can reach the group's sockets could run code in every rank."""
    import torch
    import torch.distributed as dist

    mine = dist.get_rank() == src
    data = json.dumps(obj).encode() if mine else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        dist.broadcast(buf, src=src, group=group)
    return _parse(buf, "broadcast")


def all_gather_json(obj, group=None) -> list:
    """Every rank's ``obj`` (JSON-able), in rank order, as bytes in tensors (never pickled)."""
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode()
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    width = max(int(x) for x in sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    got = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(got, buf, group=group)
    return [_parse(g[: int(k)], "all-gather") for g, k in zip(got, sizes)]


def _parse(buf, what: str):
    try:
        return json.loads(bytes(buf.numpy()))
    except ValueError as e:
        raise RuntimeError(
            f"a start-up {what} between the ranks carried malformed JSON ({e}): is every rank "
            f"running the same StaleFlow?"
        ) from None
