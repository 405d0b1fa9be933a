"""Benchmark: Parameter Server pull and Trajectory Server ring throughput vs plain tensor copies.

Run: python scripts/bench_servers.py [--param-mb 128] [--prompt 512 --response 4096 --records 200]
     [--device cpu|cuda]

- pull: ``ParameterServer.pull(v, out=...)`` of a model-like state dict (every tensor copied in
  place out of the shared slot, under the slot lock and seqlock checks), against one plain
  ``copy_`` of a flat tensor of the same bytes (the baseline; a per-tensor copy between
  ordinary tensors is printed too).
- ring: ``write`` + ``read`` + ``free`` of records (a TrajectoryTokens payload: prompt, response, log-probs,
  versions; rewards live in the controller's ledger, not in the ring), against the same tensors copied into a preallocated buffer and cloned back
  out, record by record (the baseline). A flat copy of all the bytes is printed for reference.
- manager: staleness-manager reserve+occupy pairs/s from scripts/bench_protocol.py, if present.

Baselines and servers are measured alternately in the same run; each number is the best of
``--repeats`` timings. On CPU the clock is this process's CPU time (time.process_time) with
``--threads 1`` intra-op thread, so a busy shared machine distorts the ratios less than wall
time would; on CUDA it is wall time around device synchronisation. The last line is JSON
with pull_vs_copy and ring_vs_copy.
"""

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import uuid

import torch

from staleflow.servers import ParameterServer, ParamLayout, TrajectoryRing
from staleflow.trajectory import TrajectoryTokens


def hardware(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f" gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return (
        f"cpu={cpu} cores={os.cpu_count()} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"python={sys.version.split()[0]}{gpu}"
    )


CLOCK = time.process_time


def best(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = CLOCK()
        fn()
        sync()
        times.append(CLOCK() - t0)
    return min(times)


def model_state(total_mb: int) -> dict[str, torch.Tensor]:
    """A Llama-like state dict of about ``total_mb`` MB in fp32 (hidden 512, vocab 16k, 4x MLP)."""
    h, vocab = 512, 16000
    per_layer = 4 * h * h + 3 * h * 4 * h + 2 * h
    layers = max(1, (total_mb * 2**20 // 4 - 2 * vocab * h) // per_layer)
    sd = {"embed.weight": torch.randn(vocab, h), "lm_head.weight": torch.randn(vocab, h)}
    for i in range(layers):
        for n in ("q", "k", "v", "o"):
            sd[f"layers.{i}.attn.{n}.weight"] = torch.randn(h, h)
        for n in ("gate", "up", "down"):
            sd[f"layers.{i}.mlp.{n}.weight"] = torch.randn(4 * h, h) if n != "down" else torch.randn(h, 4 * h)
        sd[f"layers.{i}.norm1.weight"] = torch.randn(h)
        sd[f"layers.{i}.norm2.weight"] = torch.randn(h)
    return sd


def bench_pull(args, device: torch.device, sync) -> dict:
    sd = {k: v.to(device) for k, v in model_state(args.param_mb).items()}
    layout = ParamLayout.from_named_tensors(sd)
    run = "b" + uuid.uuid4().hex[:10]
    ps = ParameterServer.create(run, layout, device=device)
    reader = ParameterServer.attach(run)
    try:
        ps.begin_push(1)
        for name, t in sd.items():
            ps.write_shard(name, t)
        ps.publish(1)
        out = layout.empty(device)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        src, dst = torch.randn(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
        reader.pull(1, out=out)  # warm-up: touch every page once
        dst.copy_(src)
        pull_t, flat_t, per_t = [], [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit both alike
            pull_t.append(best(lambda: reader.pull(1, out=out), 1, sync))
            flat_t.append(best(lambda: dst.copy_(src), 1, sync))
            per_t.append(best(lambda: [o.copy_(sd[k]) for k, o in out.items()], 1, sync))
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        return {
            "bytes": nbytes,
            "tensors": len(sd),
            "pull_s": min(pull_t),
            "copy_s": min(flat_t),
            "per_tensor_copy_s": min(per_t),
        }
    finally:
        reader.close()
        ps.close()


def bench_ring(args) -> dict:
    g = torch.Generator().manual_seed(0)
    recs = [
        TrajectoryTokens(
            torch.randint(0, 50000, (args.prompt,), generator=g, dtype=torch.int32),
            torch.randint(0, 50000, (args.response,), generator=g, dtype=torch.int32),
            -torch.rand(args.response, generator=g),
            torch.full((args.response,), 3, dtype=torch.int32),
        )
        for i in range(args.records)
    ]
    payload = sum(4 * (r.prompt_ids.numel() + 3 * r.response_ids.numel()) for r in recs)
    ring = TrajectoryRing.create("b" + uuid.uuid4().hex[:10], 0, 2 * payload + (1 << 20))
    reader = TrajectoryRing.attach(ring.name.split("-")[1], 0)
    fields = ("prompt_ids", "response_ids", "behaviour_logprobs", "versions")
    bufs = [[torch.empty_like(getattr(r, f)) for f in fields] for r in recs]
    flat_src, flat_dst = torch.randn(payload // 4), torch.empty(payload // 4)

    def ring_round():
        handles = [ring.write(r) for r in recs]
        got = [reader.read(h) for h in handles]
        for h in handles:
            ring.free(h)
        return got

    def plain_round():
        for r, b in zip(recs, bufs):
            for f, t in zip(fields, b):
                t.copy_(getattr(r, f))
        return [[t.clone() for t in b] for b in bufs]

    def flat_round():
        flat_dst.copy_(flat_src)
        return flat_dst.clone()

    try:
        got = ring_round()
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for a, b in zip(got, recs) for f in fields)
        ring_t, plain_t, flat_t = [], [], []
        nop = lambda: None  # noqa: E731
        for _ in range(args.repeats):
            ring_t.append(best(ring_round, 1, nop))
            plain_t.append(best(plain_round, 1, nop))
            flat_t.append(best(flat_round, 1, nop))
        return {
            "bytes": payload,
            "records": len(recs),
            "ring_s": min(ring_t),
            "plain_s": min(plain_t),
            "flat_s": min(flat_t),
        }
    finally:
        reader.close()
        ring.close()
        ring.unlink()


def manager_ops_per_s() -> float | None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_protocol.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("bench_protocol", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    n = 50_000
    return max(n / mod.run_manager(n, 2, 64, 64)[0] for _ in range(3))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--param-mb", type=int, default=128)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=4096)
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", help="parameter-server transport: cpu (shared memory) or cuda (IPC)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    p.add_argument("--no-manager", action="store_true", help="skip the staleness-manager numbers")
    a = p.parse_args()
    device = torch.device(a.device)
    global CLOCK
    CLOCK = time.perf_counter if device.type == "cuda" else time.process_time
    torch.set_num_threads(a.threads)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    print(f"hardware: {hardware(device)}")
    print(f"clock: {CLOCK.__name__}")
    pull = bench_pull(a, device, sync)
    gb = pull["bytes"] / 1e9
    print(f"pull: {pull['tensors']} tensors, {pull['bytes'] / 2**20:.0f} MiB on {device}, best of {a.repeats}")
    print(f"  {'what':<44}{'GB/s':>10}")
    print(f"  {'ParameterServer.pull(v, out) (in place)':<44}{gb / pull['pull_s']:>10.2f}")
    print(f"  {'baseline: one flat copy_ of the same bytes':<44}{gb / pull['copy_s']:>10.2f}")
    print(f"  {'per-tensor copy_ between plain tensors':<44}{gb / pull['per_tensor_copy_s']:>10.2f}")
    pull_vs_copy = pull["copy_s"] / pull["pull_s"]
    print(f"  pull / copy = {pull_vs_copy:.3f} (target >= 0.8 on CPU)")
    ring = bench_ring(a)
    rgb = ring["bytes"] / 1e9
    print(
        f"ring: {ring['records']} records x (prompt {a.prompt} + response {a.response} tokens), "
        f"{ring['bytes'] / 2**20:.1f} MiB payload, best of {a.repeats}"
    )
    print(f"  {'ring write + read + free':<44}{rgb / ring['ring_s']:>10.2f}")
    print(f"  {'baseline: per-record copy in + clone out':<44}{rgb / ring['plain_s']:>10.2f}")
    print(f"  {'flat copy in + clone out of all bytes':<44}{rgb / ring['flat_s']:>10.2f}")
    ring_vs_copy = ring["plain_s"] / ring["ring_s"]
    print(f"  ring / copy = {ring_vs_copy:.3f}  (records/s through the ring: {ring['records'] / ring['ring_s']:,.0f})")
    mgr = None if a.no_manager else manager_ops_per_s()
    if mgr is not None:
        print(f"manager: {mgr:,.0f} reserve+occupy pairs/s (scripts/bench_protocol.py run_manager, CPU time)")
    print(
        json.dumps(
            {
                "pull_vs_copy": round(pull_vs_copy, 4),
                "ring_vs_copy": round(ring_vs_copy, 4),
                "manager_ops_per_s": None if mgr is None else round(mgr),
                "pull_gb_s": round(gb / pull["pull_s"], 3),
                "copy_gb_s": round(gb / pull["copy_s"], 3),
                "ring_gb_s": round(rgb / ring["ring_s"], 3),
                "ring_plain_gb_s": round(rgb / ring["plain_s"], 3),
                "ring_vs_flat_copy": round(ring["flat_s"] / ring["ring_s"], 4),
                "ring_records_per_s": round(ring["records"] / ring["ring_s"]),
                "param_bytes": pull["bytes"],
                "device": str(device),
            }
        )
    )


if __name__ == "__main__":
    main()
