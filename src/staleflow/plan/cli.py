"""``python -m staleflow plan [train flags] [--gpu-memory-gib G] [--nproc N] [--gpus K] [--device cuda|cpu]``

Parses the run's flags exactly as ``train`` does (same RunConfig, presets and tyro parsing), builds
the memory plan (staleflow.plan) and prints a per-rank table, per-GPU totals and, last, one JSON
line ``{"fits": ..., "max_gpu_gib": ..., ...}``. Exit 0 when it fits, 1 when it does not (the
line before the JSON names the flag to change).

    --gpu-memory-gib G   memory of one GPU (default: this machine's GPU 0, else 80)
    --nproc N            processes of the run, torchrun's --nproc_per_node (default: $STALEFLOW_NPROC,
                         else 2 x --rollout.ranks: as many trainer ranks as rollout ranks)
    --gpus K             GPUs of the node (default: N, one per process; fewer are shared round-robin)
    --nodes K            nodes of N processes each (default 1), ranks numbered node by node as torchrun
                         does (trainer ranks first: on several nodes when --rollout.ranks leaves them
                         there); prints each node's memory and the bytes one weight update moves
                         between nodes, and counts the pulls' NCCL groups (--cluster.sharding: how
                         the trainer spreads over its nodes)
    --device cuda|cpu    plan for GPUs (default) or for a CPU run (host memory, not enforced)
    --preset NAME        the run's starting config, as train takes it (default smollm2-cpu)
    --config FILE        a .yaml / .toml file of the run's flags (flags given here win)
"""

from __future__ import annotations

import os
import sys

from staleflow.config import ConfigError

PLAN_FLAGS = {"--gpu-memory-gib": float, "--nproc": int, "--gpus": int, "--device": str, "--nodes": int}


def take_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """Remove the plan's own flags (``--flag V`` or ``--flag=V``) from argv."""
    found, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in PLAN_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            try:
                found[name] = PLAN_FLAGS[name](value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is invalid: expected {PLAN_FLAGS[name].__name__}") from None
        else:
            rest.append(arg)
        i += 1
    if found.get("--device", "cuda") not in ("cuda", "cpu"):
        raise ConfigError(f"--device={found['--device']!r} is invalid: use cuda or cpu")
    for name in ("--gpu-memory-gib", "--nproc", "--gpus", "--nodes"):
        if name in found and found[name] <= 0:
            raise ConfigError(f"{name}={found[name]!r} is invalid: must be > 0")
    return found, rest


def _default_gpu_bytes() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
    except Exception:  # no usable CUDA here: plan for the common 80 GiB card
        pass
    return 80 << 30


def usage() -> str:
    """The plan's own help: its usage line and flags (the run's flags are train's, listed by its --help)."""
    text = (__doc__ or "").strip().replace("``", "")
    head, _, rest = text.partition("\n\n")
    flags = rest[rest.index("    --gpu-memory-gib") :] if "    --gpu-memory-gib" in rest else rest
    return (
        f"usage: {head}\n\n"
        "staleflow plan: print the memory plan of a run (per rank, per GPU; no GPU needed) and exit 1 if it does "
        "not fit.\n\n"
        f"plan options:\n{flags}\n\n"
        "Every flag of the run itself is accepted as train takes it (--preset NAME, --rollout.ranks N, ...):\n"
        "see python -m staleflow train --help."
    )


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    from staleflow.config import RunConfig, resolve
    from staleflow.config.parse import parse
    from staleflow.plan import build_plan
    from staleflow.plan.report import json_line, notes, table
    from staleflow.presets import PRESETS

    flags, rest = take_flags(list(argv))
    cfg = resolve(parse(RunConfig, rest, PRESETS, default="smollm2-cpu", prog="staleflow plan"))
    nodes = flags.get("--nodes", 1)
    nproc = flags.get("--nproc") or int(os.environ.get("STALEFLOW_NPROC", 0)) or 2 * cfg.rollout.ranks // nodes
    gpu_bytes = int(flags["--gpu-memory-gib"] * (1 << 30)) if "--gpu-memory-gib" in flags else _default_gpu_bytes()
    plan = build_plan(
        cfg,
        nproc * nodes,
        gpu_bytes,
        device_type=flags.get("--device", "cuda"),
        num_gpus=flags.get("--gpus") or nproc,
        nodes=nodes,
    )
    print(table(plan))
    print(notes(plan))
    if not plan.fits:
        print(plan.advice(), file=sys.stderr)
    print(json_line(plan), flush=True)
    return 0 if plan.fits else 1
