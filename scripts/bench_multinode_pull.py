"""Benchmark: one rollout rank's weight pull when the trainer spans nodes, against the same run's
single-trainer-node layouts, on one machine (three processes; two of them stand for two nodes:
node identity is the runtime's, the transport the multi-node one, gloo over loopback TCP).

    python scripts/bench_multinode_pull.py                 # SmolLM2-135M's shapes in fp32 (540 MB)
    python scripts/bench_multinode_pull.py --model tiny-llama --reps 5

Layouts (the Parameter Server pieces as cluster/placement.py places them on CPU, the puller on node 1):
  local     every trainer rank on node 1 with the puller: one piece, copied from shared memory
            (a single-node run)
  remote    every trainer rank on node 0, the puller alone on node 1: one piece, all of it over
            gloo (the only multi-node layout before issue 54)
  sharded   trainer ranks on both nodes (FSDP over 2, one per node): the puller copies node 1's piece
            from shared memory and node 0's over gloo, each from its owner (the copy plan)
Prints the median seconds per pull (after one warm-up), the bytes each node's pieces gave, GB/s, the
ratios against ``local`` and ``remote``, the machine, and a last JSON line. The owners keep their
versions published (no push during the pulls: this times the transport, not contention).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from staleflow.metrics.hardware import cpu_name


def _topology(layout_name: str):
    from staleflow.cluster.roles import Roles
    from staleflow.cluster.topology import Topology

    nodes = {"local": [1, 1, 1], "remote": [0, 1, 1], "sharded": [0, 1, 1]}[layout_name]
    rollout = {"local": 1, "remote": 2, "sharded": 1}[layout_name]  # ranks: owner(s) first, the puller last
    # "remote": rank 1 is a second rollout rank on node 1 that does nothing (trainer ranks come first)
    return Topology.from_ranks(Roles(3, rollout), nodes, [0, 0, 1])


def _rank(rank: int, store: str, model: str, layouts: list[str], reps: int, result: str, secret: bytes) -> None:
    from staleflow.model import lazy_model
    from staleflow.net.curve import RunKeys, SecureContext
    from staleflow.servers import ParamLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    group = dist.new_group([0, 2])  # every layout's remote owner is rank 0, the puller rank 2
    lm, weights = lazy_model(model)
    layout = ParamLayout.from_named_tensors(lm.named_parameters(), dtype=torch.float32)
    secure = SecureContext(RunKeys(secret, 3), f"rank {rank}", rank)
    rows = {}
    for name in layouts:  # one process start and one model load for every layout
        got = _layout(rank, name, layout, weights, reps, group, secure)
        if got is not None:
            rows[name] = got
    if rank == 2:
        with open(result, "w") as f:
            json.dump(rows, f)
    secure.close()
    dist.destroy_process_group()


def _layout(rank: int, layout_name: str, layout, weights, reps: int, group, secure) -> dict | None:
    """One layout: the owners fill and publish their pieces, rank 2 pulls ``reps`` + 1 times."""
    from staleflow.cluster.placement import slot_placement
    from staleflow.servers import ParameterServer
    from staleflow.servers.remote_weights import RemoteWeights, WeightServer

    topo = _topology(layout_name)
    place = slot_placement(topo, "cpu")
    run_id = f"{os.environ['BENCH_RUN']}{layout_name[0]}"
    owners = {p.owner: i for i, p in enumerate(place.pieces)}
    endpoint, ps, server, row = [""], None, None, None
    if rank in owners:
        spec = place.pieces[owners[rank]]
        ps = ParameterServer.create(run_id, layout, pieces=place.pieces, node=spec.node)
        ps.begin_push(0)
        for name, t in weights():
            a, b = spec.rows(tuple(t.shape))
            width = t[0].numel() if t.dim() else 1
            if b > a:
                ps.write_shard(name, t.reshape(-1)[a * width : b * width], a * width)
        ps.end_push()
        ps.publish(0)
        if spec.node != topo.node_of(2):
            sock, endpoint[0] = secure.server(zmq.ROUTER, "127.0.0.1", b"weights")
            server = WeightServer(ps, owners[rank], sock, {2: group}, "cpu")
    dist.broadcast_object_list(endpoint, src=0)
    if rank == 2:
        node = topo.node_of(2)
        out = layout.empty()
        remote = [p for p in place.pull_plan(node, 2) if place.pieces[p].node != node]
        local = ParameterServer.attach(run_id, timeout=60, node=node) if place.on_node(node) else None
        if remote:
            socks = {p: secure.client(zmq.DEALER, endpoint[0]) for p in remote}
            puller = RemoteWeights(socks, place.pieces, group, "cpu", local=local)
            pull = lambda: puller.pull_latest(out)[1]  # noqa: E731
        else:
            pull = lambda: (local.pull_latest(out), {node: layout.piece_bytes(place.pieces[0])})[1]  # noqa: E731
        pull()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            by_node = pull()
            times.append(time.perf_counter() - t0)
        row = {"seconds": statistics.median(times), "by_node": by_node}
        (puller if remote else local).close()
    dist.barrier()  # the puller is done before any owner closes its piece
    if server is not None:
        server.close()
    if ps is not None:
        ps.close()
    return row


def bench(model: str, layouts: list[str], reps: int) -> list[dict]:
    from staleflow.net.curve import new_secret

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        os.environ["BENCH_RUN"] = "bm" + uuid.uuid4().hex[:8]
        args = (os.path.join(tmp, "store"), model, layouts, reps, result, new_secret())
        mp.spawn(_rank, args=args, nprocs=3, join=True)
        with open(result) as f:
            got = json.load(f)
    rows = []
    for name in layouts:
        g = got[name]
        nbytes = sum(g["by_node"].values())
        rows.append(
            {
                "layout": name,
                "seconds": round(g["seconds"], 4),
                "bytes_by_node": {str(k): v for k, v in sorted(g["by_node"].items(), key=lambda kv: int(kv[0]))},
                "gb_per_s": round(nbytes / g["seconds"] / 1e9, 3),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name or folder (its shapes, fp32)")
    ap.add_argument("--reps", type=int, default=5, help="timed pulls per layout (median)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: give at least 1 timed pull per layout")
    hardware = (
        f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, one thread per process, "
        f"gloo over loopback TCP"
    )
    print(f"hardware: {hardware}; model {args.model} (fp32 slots), {args.reps} timed pulls per layout")
    rows = bench(args.model, ["local", "remote", "sharded"], args.reps)
    base = {r["layout"]: r["seconds"] for r in rows}
    print(f"{'layout':<9} {'s/pull':>8} {'GB/s':>7} {'x local':>8} {'x remote':>9}  bytes by node")
    for r in rows:
        r["vs_local"] = round(r["seconds"] / base["local"], 2)
        r["vs_remote"] = round(r["seconds"] / base["remote"], 2)
        mb = ", ".join(f"node {n}: {b / 1e6:.1f} MB" for n, b in r["bytes_by_node"].items())
        print(
            f"{r['layout']:<9} {r['seconds']:>8.4f} {r['gb_per_s']:>7.3f} {r['vs_local']:>8.2f} "
            f"{r['vs_remote']:>9.2f}  {mb}"
        )
    print(json.dumps({"hardware": hardware, "model": args.model, "reps": args.reps, "rows": rows}))


if __name__ == "__main__":
    main()
