"""Multi-process checks of the data plane, run under torchrun (tests and GPU device checks).

    torchrun --standalone --nproc_per_node=3 tests/servers_selftest.py param --run-id X [--device cuda]
    torchrun --standalone --nproc_per_node=3 tests/servers_selftest.py ring --run-id X --ipc-dir DIR

param: rank 0 (trainer leader) pushes versions 1..V as fast as it can, writing each tensor in
two shards; ranks 1..N-1 pull the latest version concurrently, with no seqlock retries
allowed, and check every tensor bit for bit against values derived from the version (so a
read mixing two versions fails). Then rank 1 broadcast_pulls the last version to the others.
ring: rank 0 produces records of random sizes into a small ring and frees a record only when
a reader acknowledged it, so the ring fills (RingFull) and drains repeatedly; readers check
every record against a regenerated copy. Each rank prints one JSON line; a failure exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import msgspec
import torch
import torch.distributed as dist

from staleflow.servers import (
    ParameterServer,
    ParamLayout,
    RecordHandle,
    RingFull,
    TrajectoryRing,
    VersionNotFound,
    broadcast_pull,
)
from staleflow.trajectory import TrajectoryTokens

SHAPES = {
    "embed.weight": ((96, 64), torch.float32),
    "layers.0.mlp.weight": ((128, 96), torch.bfloat16),
    "layers.0.norm.weight": ((64,), torch.float32),
    "step": ((), torch.int64),
}


def version_tensors(version: int, device="cpu") -> dict[str, torch.Tensor]:
    """Every tensor of ``version`` derived from it (exactly representable in each dtype)."""
    out = {}
    for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        n = int(torch.Size(shape).numel())
        vals = (torch.arange(n, dtype=torch.float64) % 61) + 64 * (version % 3 + 1) + i  # <= 256: exact in bf16
        out[name] = (vals + version * 1000 if dtype == torch.int64 else vals).to(dtype).view(shape).to(device)
    return out


def _check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name, w in want.items():
        g = got[name].to(w.device)
        if g.dtype != w.dtype or not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{what}: tensor {name} differs from the pushed bytes")


def run_param(args, rank: int, world: int) -> dict:
    device = torch.device(args.device)
    versions = args.versions
    group = dist.new_group(list(range(1, world)))  # every rank creates it, before anything else
    if rank == 0:
        layout = ParamLayout.from_named_tensors(version_tensors(0))
        ps = ParameterServer.create(args.run_id, layout, device=device, readers=world)  # reader index = rank
        dist.barrier()
        for v in range(1, versions + 1):
            ps.begin_push(v)
            for name, t in version_tensors(v, device).items():
                flat = t.reshape(-1)
                half = flat.numel() // 2
                ps.write_shard(name, flat[:half], 0)  # two shards, as two trainer ranks would write them
                ps.write_shard(name, flat[half:], half)
            ps.publish(v)
        dist.barrier()  # readers done
        stats = {"pushed": versions}
    else:
        dist.barrier()
        ps = ParameterServer.attach(args.run_id, timeout=30, reader=rank)
        out = ps.layout.empty(device)
        pulled, gone, last = [], 0, None
        while last != versions:
            latest = ps.latest_version()
            if latest is None or latest == last:
                time.sleep(0.0002)
                continue
            try:
                ps.pull(latest, out=out, retries=0)
            except VersionNotFound:
                gone += 1  # overwritten between latest_version() and the lock: allowed, counted
                continue
            _check_equal(out, version_tensors(latest, device), f"rank {rank} pull of version {latest}")
            pulled.append(latest)
            last = latest
        v2, _ = ps.pull_latest(out=out)
        if v2 != versions:
            raise AssertionError(f"pull_latest returned {v2}, expected {versions}")
        try:
            ps.pull(0)
            raise AssertionError("pull of a never-published version did not raise")
        except VersionNotFound:
            pass
        dist.barrier()
        stats = {
            "pulled": len(pulled),
            "distinct": len(set(pulled)),
            "gone": gone,
            "increasing": pulled == sorted(set(pulled)),
        }
        if not stats["increasing"]:
            raise AssertionError(f"rank {rank} pulled versions out of order: {pulled}")
    # Broadcast path: rank 1 holds the last version; the other readers receive it (gloo: CPU tensors).
    if rank >= 1:
        tensors = (
            version_tensors(versions) if rank == 1 else {k: torch.zeros_like(v) for k, v in version_tensors(0).items()}
        )
        broadcast_pull(group, 1, tensors)
        _check_equal(tensors, version_tensors(versions), f"rank {rank} broadcast_pull")
    dist.barrier()
    ps.close()
    return stats


def make_record(seed: int, i: int) -> TrajectoryTokens:
    """Random tokens; every third record has a loss mask (environment tokens: 0)."""
    rng = random.Random(seed * 1_000_003 + i)
    n_p, n_r = rng.randint(1, 300), rng.randint(0, 1500)
    g = torch.Generator().manual_seed(seed * 7919 + i)
    return TrajectoryTokens(
        prompt_ids=torch.randint(0, 50_000, (n_p,), generator=g, dtype=torch.int32),
        response_ids=torch.randint(0, 50_000, (n_r,), generator=g, dtype=torch.int32),
        behaviour_logprobs=-torch.rand(n_r, generator=g) * 10,
        versions=torch.randint(0, 9, (n_r,), generator=g, dtype=torch.int32),
        loss_mask=torch.randint(0, 2, (n_r,), generator=g, dtype=torch.int32) if i % 3 == 0 else None,
    )


def run_ring(args, rank: int, world: int) -> dict:
    import zmq

    ctx = zmq.Context()
    ack_addr = f"ipc://{args.ipc_dir}/acks"
    if rank == 0:
        ring = TrajectoryRing.create(args.run_id, 0, args.ring_bytes)
        acks = ctx.socket(zmq.PULL)
        acks.bind(ack_addr)
        outs = []
        for r in range(1, world):
            s = ctx.socket(zmq.PUSH)
            s.bind(f"ipc://{args.ipc_dir}/h{r}")
            outs.append(s)
        dist.barrier()
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(tuple[int, RecordHandle])
        full, freed, in_flight = 0, 0, set()

        def free_one(timeout_ms: int) -> bool:
            if not acks.poll(timeout_ms):
                return False
            i, h = dec.decode(acks.recv())
            ring.free(h)
            in_flight.discard(i)
            return True

        for i in range(args.records):
            rec = make_record(args.seed, i)
            while True:
                try:
                    h = ring.write(rec)
                    break
                except RingFull:
                    full += 1
                    if not free_one(30_000):
                        raise AssertionError("ring stayed full: no reader acknowledged a record within 30 s") from None
                    freed += 1
                    while free_one(0):
                        freed += 1
            in_flight.add(i)
            outs[i % len(outs)].send(enc.encode((i, h)))
        for s in outs:
            s.send(enc.encode((-1, RecordHandle(0, 0, 0, 0))))
        while in_flight:
            if not free_one(30_000):
                raise AssertionError(f"records {sorted(in_flight)[:5]} were never acknowledged")
            freed += 1
        if ring.live_records or ring.used_bytes:
            raise AssertionError(f"ring not empty after all frees: {ring.live_records} records, {ring.used_bytes} B")
        dist.barrier()
        ring.close()
        ring.unlink()
        stats = {"written": args.records, "ring_full": full, "freed": freed}
        if full == 0:
            raise AssertionError("back-pressure never happened: make the ring smaller")
        for s in [acks, *outs]:
            s.close(linger=0)
        for name in ["acks", *(f"h{r}" for r in range(1, world))]:
            try:
                os.unlink(os.path.join(args.ipc_dir, name))
            except FileNotFoundError:
                pass
    else:
        inp = ctx.socket(zmq.PULL)
        inp.connect(f"ipc://{args.ipc_dir}/h{rank}")
        ack = ctx.socket(zmq.PUSH)
        ack.connect(ack_addr)
        dist.barrier()
        ring = TrajectoryRing.attach(args.run_id, 0, timeout=30)
        dec = msgspec.msgpack.Decoder(tuple[int, RecordHandle])
        enc = msgspec.msgpack.Encoder()
        n = 0
        while True:
            if not inp.poll(60_000):
                raise AssertionError(f"rank {rank}: no handle from the producer within 60 s")
            i, h = dec.decode(inp.recv())
            if i < 0:
                break
            got, want = ring.read(h), make_record(args.seed, i)
            for f in ("prompt_ids", "response_ids", "behaviour_logprobs", "versions"):
                if not torch.equal(getattr(got, f), getattr(want, f)):
                    raise AssertionError(f"rank {rank}: record {i} field {f} differs from what was written")
            if got.mask_values() != want.mask_values():
                raise AssertionError(f"rank {rank}: record {i} loss_mask differs from what was written")
            ack.send(enc.encode((i, h)))
            n += 1
        ring.close()
        dist.barrier()
        stats = {"read": n}
        inp.close(linger=0)
        ack.close(linger=1000)
    ctx.term()
    return stats


def _report(row: dict) -> None:
    """One JSON line in ONE write: the ranks share a pipe, and print() writes the text and the
    newline separately, so two ranks' lines could interleave."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(row) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["param", "ring"])
    p.add_argument("--run-id", required=True)
    p.add_argument("--device", default="cpu", help="param: cpu (shared memory) or cuda (CUDA IPC)")
    p.add_argument("--versions", type=int, default=200)
    p.add_argument("--ipc-dir", default="/tmp")
    p.add_argument("--ring-bytes", type=int, default=48 << 10)
    p.add_argument("--records", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        stats = (run_param if args.mode == "param" else run_ring)(args, rank, world)
        _report({"rank": rank, "mode": args.mode, "ok": True, **stats})
        return 0
    except Exception as e:  # one line naming the failure; torchrun then stops the other ranks
        _report({"rank": rank, "mode": args.mode, "ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
