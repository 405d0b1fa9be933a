"""Benchmark: memory to build a sharded trainer, the lazy shard-wise load vs the full load first.

    python scripts/bench_trainer_load.py                       # SmolLM2-135M, 2 trainer ranks, CPU (gloo)
    python scripts/bench_trainer_load.py --model tiny-llama --ranks 4 --stored-dtype as-is

The model is first saved in --stored-dtype (default bfloat16, as most Hugging Face checkpoints
are, e.g. Qwen2.5-7B): the fp32 master weights are then new memory on CPU as they are on a GPU.
(An fp32 file on CPU is mmapped and its tensors alias the page cache, so there the full load costs
no anonymous memory; on a GPU every loaded tensor is an allocation.)

Each path runs in its own `torchrun --nproc_per_node=RANKS` (fresh processes, so the peaks do not
mix). Every rank measures, from just before the load to the built Trainer:
- baseline "full": `load_model` (the whole fp32 model on the rank), then `Trainer(model, ...)`
  shards it (what `launch/entry.py` did before);
- "lazy": `lazy_model` (meta device) and `Trainer(model, ..., weights=...)`: shard first, then
  keep only this rank's rows of each tensor, streamed one at a time.
Memory is anonymous resident memory (RssAnon, sampled every 2 ms: the allocations, not the page
cache of the mmapped safetensors file) and the process's peak RSS (VmHWM, which does count the
file's pages). On a GPU the same code allocates on the device; `staleflow plan` gives that peak.
Prints a table and, as the last line, one JSON object with both paths and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status (Linux only)")


def _worker(model_name: str, path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from staleflow.config import TrainConfig
    from staleflow.model import lazy_model, load_model, resolve_model_path
    from staleflow.train.trainer import Trainer

    dist.init_process_group("gloo")
    folder = resolve_model_path(model_name)  # built into the cache before timing (an alias's first use)
    torch.set_num_threads(1)
    dist.barrier()
    peak, stop = [_status("RssAnon")], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    before = _status("RssAnon")
    t.start()
    t0 = time.perf_counter()
    if path == "lazy":
        model, weights = lazy_model(folder)
        trainer = Trainer(model, TrainConfig(), process_group=dist.group.WORLD, weights=weights())
    else:
        trainer = Trainer(load_model(folder), TrainConfig(), process_group=dist.group.WORLD)
    seconds = time.perf_counter() - t0
    stop.set()
    t.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    after = _status("RssAnon")
    shard = sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters())
    full = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    rows = [None] * dist.get_world_size()
    row = {
        "rank": dist.get_rank(),
        "peak_anon": peak[0] - before,
        "kept_anon": after - before,
        "vm_hwm": _status("VmHWM"),
        "shard": shard,
        "full": full,
        "s": seconds,
    }
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as the runtime's ranks leave (staleflow.cli._leave): no gloo finalisation race


def _run(model: str, ranks: int, path: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            __file__,
            "--worker",
            path,
            "--model",
            model,
            "--out",
            out,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"the {path} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--stored-dtype", default="bfloat16", choices=["bfloat16", "float32", "as-is"])
    ap.add_argument("--worker", choices=["full", "lazy"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return _worker(a.model, a.worker, a.out)
    import torch

    from staleflow.model import load_model, resolve_model_path, save_hf

    folder = resolve_model_path(a.model)  # an alias is built once, here, not inside the measured runs
    with tempfile.TemporaryDirectory() as tmp:
        if a.stored_dtype != "as-is":
            dt = getattr(torch, a.stored_dtype)
            m = load_model(folder)
            folder = str(save_hf(m, Path(tmp) / "model", state_dict={k: v.to(dt) for k, v in m.state_dict().items()}))
            del m
        res = {path: _run(folder, a.ranks, path) for path in ("full", "lazy")}
    mib = 2**20
    print(
        f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {a.model} stored as "
        f"{a.stored_dtype}, {a.ranks} trainer ranks (gloo, CPU)"
    )
    print(
        f"{'path':>6} {'rank':>4} {'peak anon MiB':>14} {'kept MiB':>9} {'VmHWM MiB':>10} {'shard MiB':>10} "
        f"{'full MiB':>9} {'s':>6}"
    )
    for path, rows in res.items():
        for r in rows:
            print(
                f"{path:>6} {r['rank']:>4} {r['peak_anon'] / mib:>14.0f} {r['kept_anon'] / mib:>9.0f} "
                f"{r['vm_hwm'] / mib:>10.0f} {r['shard'] / mib:>10.0f} {r['full'] / mib:>9.0f} {r['s']:>6.2f}"
            )
    worst = {path: max(r["peak_anon"] for r in rows) for path, rows in res.items()}
    hwm = {path: max(r["vm_hwm"] for r in rows) for path, rows in res.items()}
    print(
        json.dumps(
            {
                "model": a.model,
                "stored_dtype": a.stored_dtype,
                "ranks": a.ranks,
                "full_model_mib": round(res["lazy"][0]["full"] / mib, 1),
                "shard_mib": round(max(r["shard"] for r in res["lazy"]) / mib, 1),
                "baseline_full_peak_anon_mib": round(worst["full"] / mib, 1),
                "lazy_peak_anon_mib": round(worst["lazy"] / mib, 1),
                "lazy_vs_full_peak_anon": round(worst["lazy"] / worst["full"], 3),
                "baseline_full_vm_hwm_mib": round(hwm["full"] / mib, 1),
                "lazy_vm_hwm_mib": round(hwm["lazy"] / mib, 1),
                "lazy_vs_full_vm_hwm": round(hwm["lazy"] / hwm["full"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
