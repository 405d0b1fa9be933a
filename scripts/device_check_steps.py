"""Steps of scripts/device_check.sh that need more than a test file: each prints one JSON line last.

    python scripts/device_check_steps.py trainer [--device cuda]   # 1-rank NCCL FSDP2 bf16 step,
                                                                   # Triton vs chunked log-probs (by hand:
                                                                   # device_check.sh runs trainer_7b instead)
    python scripts/device_check_steps.py ps [--device cuda]        # bf16 Parameter Server write by two
                                                                   # piece owners, CUDA IPC pulls by two
                                                                   # other processes, context size
    python scripts/device_check_steps.py env                       # driver, CUDA, NCCL, torch, Triton,
                                                                   # /dev/shm, torch.mm out_dtype support
``--device cpu`` runs the same code on CPU (gloo, chunked vs naive log-probs, shared-memory slots):
a smoke test of this script, tests/test_device_check.py. Numbers are measurements of this run.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import socket
import sys
import time
import uuid

import torch

GiB = 2**30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(vocab: int, groups: int, group_size: int, prompt: int, response: int, seed: int = 0):
    """Trainer.step's (groups, payloads): random groups with random 0/1 rewards. The payloads are in no ring, so the
    groups' handles are stand-ins (rank -1): the trainer is given the payloads and never reads them."""
    from staleflow.trajectory import RecordHandle, TrainGroup, TrajectoryTokens

    rng = random.Random(seed)
    out_groups, out_payloads = [], []
    for g in range(groups):
        p = [rng.randrange(vocab) for _ in range(prompt)]
        members, rewards = [], []
        for _ in range(group_size):
            n = rng.randint(response // 2, response)
            members.append(
                TrajectoryTokens(
                    p, [rng.randrange(vocab) for _ in range(n)], [-rng.uniform(8.0, 11.0) for _ in range(n)], [0] * n
                )
            )
            rewards.append(float(rng.randint(0, 1)))
        ids = [g * group_size + k for k in range(group_size)]
        handles = [RecordHandle(-1, 0, 0, 0)] * group_size
        out_groups.append(TrainGroup(g, 0, ids, handles, rewards, [len(t.response_ids) for t in members], prompt))
        out_payloads.append(members)
    return out_groups, out_payloads


def step_trainer(device: str) -> dict:
    """A 1-rank process group (NCCL on CUDA) drives FSDP2 with bf16 compute; the same step with the
    Triton log-prob kernel and with the chunked PyTorch path must agree; the kernel alone is
    compared at a 7B LM-head shape. Peak memory is set beside the memory plan's estimate."""
    import torch.distributed as dist

    from staleflow.config import RolloutConfig, RunConfig, TrainConfig
    from staleflow.model import CausalLM, ModelArgs
    from staleflow.plan.estimate import trainer_rank
    from staleflow.train.logprobs import packed_logprobs
    from staleflow.train.trainer import Trainer

    cuda = device == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    args = ModelArgs(
        architecture="qwen2",
        vocab_size=32768 if cuda else 512,
        hidden_size=1024 if cuda else 64,
        intermediate_size=2816 if cuda else 128,
        num_layers=8 if cuda else 2,
        num_heads=16 if cuda else 4,
        num_kv_heads=4 if cuda else 2,
        head_dim=64 if cuda else 16,
    )
    base = CausalLM(args).init_weights(std=0.02, seed=0)
    groups, payloads = _batch(args.vocab_size, 8, 4, 128 if cuda else 8, 384 if cuda else 12)
    fast, ref = ("triton", "chunked") if cuda else ("chunked", "naive")
    out = {"device": device, "world": 1, "backend": dist.get_backend()}
    for impl in (fast, ref):
        model = CausalLM(args)
        model.load_state_dict(base.state_dict())
        cfg = TrainConfig(lr=1e-5, micro_batch_tokens=4096, logprob_impl=impl)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer = Trainer(model, cfg, device, process_group=dist.group.WORLD, max_response_tokens=384)
        m = trainer.step(groups, payloads)
        if cuda:
            torch.cuda.synchronize()
        sharded = all(hasattr(p, "to_local") for p in trainer.model.parameters())
        out[impl] = {
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "entropy": m["entropy_mean"],
            "seconds": round(time.perf_counter() - t0, 3),
            "fsdp2_sharded": sharded,
            "activation_checkpointing": trainer.model.gradient_checkpointing,
            "peak_gib": round(torch.cuda.max_memory_allocated() / GiB, 3) if cuda else None,
        }
        del trainer, model
    a, b = out[fast], out[ref]
    out["loss_rel_diff"] = abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12)
    out["grad_norm_rel_diff"] = abs(a["grad_norm"] - b["grad_norm"]) / max(b["grad_norm"], 1e-12)
    plan = trainer_rank(
        RunConfig(rollout=RolloutConfig(max_model_len=512), train=TrainConfig(micro_batch_tokens=4096)),
        args,
        0,
        1,
        device,
        0,
        flash=False,
    )
    out["plan_gib_without_contexts"] = round((plan.steady - plan.items.get("contexts", 0)) / GiB, 3)
    # the kernel at Qwen2.5-7B's LM head: 4096 rows x 3584 x 152064, bf16 in, fp32 out
    T, H, V = (4096, 3584, 152064) if cuda else (64, 32, 1000)
    g = torch.Generator(device=device).manual_seed(1)
    h = (torch.randn(T, H, device=device, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, device=device, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (T,), device=device, generator=g)
    res = {}
    for impl in (fast, ref):
        h.grad = w.grad = None
        lp, ent = packed_logprobs(h, w, y, temperature=0.9, impl=impl)
        (lp.sum() + 0.1 * ent.sum()).backward()
        res[impl] = (lp.detach().float(), ent.detach().float(), h.grad.float(), w.grad.float())
    out["kernel_shape"] = [T, H, V]
    out["kernel_logp_max_abs_diff"] = float((res[fast][0] - res[ref][0]).abs().max())
    out["kernel_entropy_max_abs_diff"] = float((res[fast][1] - res[ref][1]).abs().max())
    out["kernel_grad_rel_diff"] = float(max((res[fast][i] - res[ref][i]).norm() / res[ref][i].norm() for i in (2, 3)))
    dist.destroy_process_group()
    out["ok"] = bool(
        a["fsdp2_sharded"]
        and out["loss_rel_diff"] < 2e-2
        and out["grad_norm_rel_diff"] < 5e-2
        and out["kernel_logp_max_abs_diff"] < 2e-3
        and out["kernel_grad_rel_diff"] < 2e-2
        and (a["activation_checkpointing"] or not cuda)
    )
    return out


def _ps_tensors(version: int, device: str) -> dict[str, torch.Tensor]:
    """fp32 'master' tensors of a ~1.3 GB bf16 model (Qwen2.5-0.5B-like shapes; tiny on CPU), version-derived."""
    big = device in ("cuda", "meta")
    shapes = {
        "model.embed_tokens.weight": (151936, 896) if big else (100, 16),
        "lm_head.weight": (151936, 896) if big else (100, 16),
        "model.norm.weight": (896,) if big else (16,),
    }
    for i in range(24 if big else 2):
        shapes[f"model.layers.{i}.mlp.up_proj.weight"] = (4864, 896) if big else (24, 16)
        shapes[f"model.layers.{i}.self_attn.q_proj.bias"] = (896,) if big else (16,)
    out = {}
    for k, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)
        vals = (torch.arange(n, device=device, dtype=torch.float32) % 251) / 8 + version * 3 + k  # exact in bf16
        out[name] = vals.view(shape)
    return out


def _ps_owner(run_id: str, device: str, q) -> None:
    """Trainer rank 1: owns piece 1, writes its rows of every version the leader claims."""
    from staleflow.servers import ParameterServer
    from staleflow.servers.layout import piece_rows

    ps = ParameterServer.attach(run_id, timeout=60, **({"piece": 1, "device": device} if device == "cuda" else {}))
    q.put(("owner-ready", 0))
    for version in (1, 2):
        ps.begin_push(version)
        for name, t in _ps_tensors(version, device).items():
            a, b = piece_rows(tuple(t.shape), 2, 1)  # FSDP2's rows of rank 1 of 2
            row = math.prod(t.shape[1:])
            if b > a:
                ps.write_shard(name, t.reshape(-1)[a * row : b * row], a * row)
        ps.end_push()
        q.put(("written", version))
    ps.close()  # as piece owner: waits until the readers released it


def _ps_reader(run_id: str, device: str, reader: int, q, go) -> None:
    from staleflow.servers import ParameterServer

    ps = ParameterServer.attach(run_id, timeout=60, reader=reader)
    q.put(("attached", reader))
    for version in (1, 2):
        go.get()  # wait for the leader's publish of this version
        want = _ps_tensors(version, device)
        # an engine's parameters: bf16, the 2-D ones as transposed views of one fused matrix
        out = {
            k: (
                torch.empty(v.shape[::-1], dtype=torch.bfloat16, device=device).t()
                if v.dim() == 2
                else torch.empty(v.shape, dtype=torch.bfloat16, device=device)
            )
            for k, v in want.items()
        }
        t0 = time.perf_counter()
        ps.pull(version, out=out)
        dt = time.perf_counter() - t0
        exact = all(torch.equal(out[k], want[k].to(torch.bfloat16)) for k in want)
        nbytes = sum(t.numel() * 2 for t in want.values())
        q.put(("pulled", reader, version, exact, nbytes / dt / 1e9))
    ps.close()
    q.put(("closed", reader))


def step_deadline() -> float:
    """When this step's own waits must end: scripts/device_check_run.py sets STALEFLOW_DEVCHECK_DEADLINE a
    few seconds before the step's limit; run by hand, 120 s from now."""
    try:
        return float(os.environ["STALEFLOW_DEVCHECK_DEADLINE"])
    except (KeyError, ValueError):
        return time.time() + 120.0


def wait_for(q, kids: dict, deadline: float, what: str):
    """The next message on ``q``, or one RuntimeError as soon as a child process has failed (naming it and its
    exit code) or the deadline has passed (naming every child's state): the step reports the cause within its
    limit instead of being killed as a timeout."""
    import queue

    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            pass
        failed = [
            f"the {name} exited with code {p.exitcode}" for name, p in kids.items() if p.exitcode not in (None, 0)
        ]
        if failed:
            raise RuntimeError(f"waiting for {what}: {'; '.join(failed)} (its traceback is in this step's log)")
        if time.time() > deadline:
            states = ", ".join(
                f"{n} {'running' if p.exitcode is None else f'exit {p.exitcode}'}" for n, p in kids.items()
            )
            raise RuntimeError(f"waiting for {what}: nothing before this step's limit ({states})")


def step_ps(device: str) -> dict:
    """Two piece owners write fp32 shards into bf16 slots on the GPU; two other processes, each with
    its own reader index, pull by CUDA IPC into strided bf16 tensors and check every byte."""
    from staleflow.servers import ParameterServer, ParamLayout
    from staleflow.servers.layout import piece_rows

    cuda = device == "cuda"
    ctx = mp.get_context("spawn")
    q, owner_q, gos = ctx.Queue(), ctx.Queue(), [ctx.Queue(), ctx.Queue()]
    run_id = "dc" + uuid.uuid4().hex[:8]
    layout = ParamLayout.from_named_tensors(_ps_tensors(0, device), dtype=torch.bfloat16)
    leader = ParameterServer.create(run_id, layout, device=device, pieces=2 if cuda else 1, readers=4)
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    owner = ctx.Process(target=_ps_owner, args=(run_id, device, owner_q))
    owner.start()
    deadline = step_deadline()
    kids = {"piece owner": owner}
    if wait_for(owner_q, kids, deadline, "the piece owner's start")[0] != "owner-ready":
        raise RuntimeError("the piece owner did not start")
    free1 = torch.cuda.mem_get_info()[0] if cuda else 0
    readers = [ctx.Process(target=_ps_reader, args=(run_id, device, r, q, gos[i])) for i, r in enumerate((2, 3))]
    for p in readers:
        p.start()
    kids.update({f"reader {r}": p for r, p in zip((2, 3), readers)})
    attached = [wait_for(q, kids, deadline, "the readers' attach") for _ in readers]
    free2 = torch.cuda.mem_get_info()[0] if cuda else 0
    out = {"device": device, "slot_gib": round(layout.nbytes / GiB, 3), "pieces": leader.pieces, "pulls": []}
    closed: list = []
    for version in (1, 2):
        leader.begin_push(version)
        t0 = time.perf_counter()
        for name, t in _ps_tensors(version, device).items():
            a, b = piece_rows(tuple(t.shape), 2, 0)  # FSDP2's rows of rank 0 of 2
            row = math.prod(t.shape[1:])
            if b > a:
                leader.write_shard(name, t.reshape(-1)[a * row : b * row], a * row)
        leader.end_push()
        out[f"write_s_v{version}"] = round(time.perf_counter() - t0, 4)
        if wait_for(owner_q, kids, deadline, f"the piece owner's write of version {version}") != ("written", version):
            raise RuntimeError(f"the piece owner did not write version {version}")
        leader.publish(version)
        for g in gos:
            g.put(version)
        pulled = 0
        while pulled < len(readers):  # a fast reader's "closed" may come before a slow one's pull
            msg = wait_for(q, kids, deadline, f"the pulls of version {version}")
            if msg[0] == "closed":
                closed.append(msg)
                continue
            pulled += 1
            out["pulls"].append({"reader": msg[1], "version": msg[2], "exact": msg[3], "gb_s": round(msg[4], 1)})
    closed += [wait_for(q, kids, deadline, "the readers' close") for _ in range(len(readers) - len(closed))]
    for p in readers + [owner]:
        p.join(timeout=max(0.0, deadline - time.time()))
    t0 = time.perf_counter()
    leader.close()  # waits until no reader maps its piece
    out["close_s"] = round(time.perf_counter() - t0, 3)
    piece1 = 2 * layout.split(2)[1].nbytes
    out["owner_context_gib"] = round((free0 - free1 - piece1) / GiB, 3) if cuda else None
    out["reader_context_gib_each"] = round((free1 - free2) / len(readers) / GiB, 3) if cuda else None
    out["ok"] = (
        len(attached) == 2
        and len(closed) == 2
        and len(out["pulls"]) == 4
        and all(p["exact"] for p in out["pulls"])
        and all(p.exitcode == 0 for p in readers + [owner])
    )
    return out


def _works(fn) -> bool | str:
    try:
        fn()
        return True
    except Exception as e:  # what the kernels' fallbacks catch: recorded, not raised
        return f"no ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def kernel_info(proc_version: str | None = None, dmesg: str | None = None) -> dict:
    """The kernel as the run sees it: ``uname -r`` and whether it is a sandbox that may refuse CUDA
    IPC (gVisor: its dmesg starts "Starting gVisor...", its /proc/version fakes Linux 4.4.0 of
    2016). ``sandbox`` is "gvisor" or None; device_check.sh skips the IPC steps under gVisor."""
    import platform
    import subprocess

    if proc_version is None:
        try:
            with open("/proc/version") as f:
                proc_version = f.read().strip()
        except OSError:
            proc_version = ""
    if dmesg is None:
        try:
            dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout[:4000]
        except (OSError, subprocess.SubprocessError):
            dmesg = ""
    gvisor = (
        "gvisor" in dmesg.lower()
        or "gvisor" in proc_version.lower()
        or proc_version.startswith("Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016")
    )
    return {"kernel": platform.release(), "proc_version": proc_version[:160], "sandbox": "gvisor" if gvisor else None}


def step_env(device: str) -> dict:
    """The machine as the run sees it: versions, the GPU, /dev/shm, and whether cuBLAS accumulates a
    bf16 GEMM into fp32 (``torch.mm(out_dtype=)``, and in place with ``addmm(out=)``), which decides
    the log-prob backward's workspace (plan/transients.py)."""
    import platform
    import subprocess

    from staleflow.launch.environment import device_line

    out: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    out.update(kernel_info())
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        out["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    out["dev_shm_gib"] = (
        {"total": round(st.f_blocks * st.f_frsize / GiB, 2), "free": round(st.f_bavail * st.f_frsize / GiB, 2)}
        if st
        else None
    )
    out["hf_hub_offline"] = os.environ.get("HF_HUB_OFFLINE")
    if device == "cuda":
        out["device_line"] = device_line(torch)
        out["gpu"] = torch.cuda.get_device_name(0)
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # a torch built without NCCL
            out["nccl"] = None
    a = torch.randn(64, 64, device=device).to(torch.bfloat16)
    acc = torch.zeros(64, 64, device=device)
    out["mm_out_dtype"] = _works(lambda: torch.mm(a, a, out_dtype=torch.float32))
    out["addmm_out_dtype_inplace"] = _works(lambda: torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc))
    out["ok"] = device != "cuda" or bool(out.get("gpu"))
    return out


def validate(step: str, device: str) -> dict:
    """What ``step`` builds on ``device``, resolved here without one: the Parameter Server layout of
    the ps step (its pieces must split it), the env step's probes (nothing to build)."""
    if step == "ps":
        from staleflow.servers import ParamLayout

        with torch.device("meta"):
            tensors = _ps_tensors(0, "meta")
        layout = ParamLayout.from_named_tensors(tensors, dtype=torch.bfloat16)
        pieces = layout.split(2 if device == "cuda" else 1)
        return {"validated": ["ps"], "slot_gib": round(layout.nbytes / GiB, 3), "pieces": len(pieces), "ok": True}
    return {"validated": [step], "ok": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("trainer", "ps", "env"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--validate", action="store_true", help="resolve what the step builds, without a device")
    args = ap.parse_args()
    if args.validate:  # scripts/device_check.sh --dry-run
        print(json.dumps(validate(args.step, args.device)))
        return 0
    if args.device == "cuda":
        torch.cuda.set_device(0)
    t0 = time.perf_counter()
    try:
        res = {"trainer": step_trainer, "ps": step_ps, "env": step_env}[args.step](args.device)
    except Exception as e:  # one JSON line even on failure: the caller's table shows the cause
        res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        import traceback

        traceback.print_exc()
    res = {"step": args.step, **res, "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(res), flush=True)
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
