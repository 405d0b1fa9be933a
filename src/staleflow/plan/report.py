"""The plan as people read it: a per-rank table, per-GPU totals, a last JSON line, and the one
flag to change when it does not fit."""

from __future__ import annotations

import json

from staleflow.plan.estimate import CATEGORIES, GiB

_HEAD = {
    "weights": "weights",
    "grads": "grads",
    "optimizer": "optim",
    "reference": "ref",
    "slots": "slots",
    "kv_cache": "kv",
    "activations": "activ",
    "buffers": "buffers",
    "workspace": "work",
    "prefill_mask": "mask",
    "graphs": "graphs",
    "logprob_bwd": "lp_bwd",
    "optim_step": "adamw",
    "contexts": "ctx",
    "slack": "slack",
}


def _g(n: int) -> str:
    return f"{n / GiB:.1f}"


def _m(n: int) -> str:
    return f"{n / 2**20:.0f}"


def _params(plan) -> str:
    if plan.active_params and plan.active_params != plan.params:
        return f"{plan.params / 1e9:.2f}B params, {plan.active_params / 1e9:.2f}B active per token"
    return f"{plan.params / 1e9:.2f}B params"


def table(plan) -> str:
    """Rows: ranks; columns: GiB per category, the load-time peak and the rank's peak."""
    cols = [c for c in CATEGORIES if any(rp.items.get(c) for rp in plan.ranks)]
    small = max((rp.peak for rp in plan.ranks), default=0) < GiB  # a tiny model: MiB columns
    f = _m if small else _g
    head = ["rank", "role", "gpu"] + [_HEAD[c] for c in cols] + ["load", "peak"]
    rows = [
        [str(rp.rank) if rp.rank >= 0 else f"rm{-1 - rp.rank}", rp.role, "-" if rp.gpu is None else str(rp.gpu)]
        + [f(rp.items.get(c, 0)) for c in cols]
        + [f(rp.load_peak), f(rp.peak)]
        for rp in plan.ranks
    ]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    unit = "MiB" if small else "GiB"
    unit += f" of {plan.gpu_bytes / GiB:.1f} GiB per GPU" if plan.device_type == "cuda" else " (cpu: host memory)"
    lines = [f"memory plan: {plan.model} ({_params(plan)}), {len(plan.ranks)} ranks, {unit}", fmt.format(*head)] + [
        fmt.format(*r) for r in rows
    ]
    for g, n in sorted(plan.per_gpu.items()):
        lines.append(f"GPU {g}: {_g(n)} GiB{'' if n <= plan.gpu_bytes else '  OVER'}")
    for r, u in sorted(plan.gpu_share.items()):
        lines.append(f"rank {r}: engine GPU share {u:.2f} (--rollout.engine {plan.engine})")
    if plan.nodes > 1:
        lines += node_lines(plan)
    return "\n".join(lines)


def node_lines(plan) -> list[str]:
    """Per node: its ranks and their memory together; then what one weight update moves between nodes."""
    lines = []
    what = "GPUs" if plan.device_type == "cuda" else "host memory"
    small = max(plan.per_node.values(), default=0) < GiB
    f, unit = (_m, "MiB") if small else (_g, "GiB")
    for node, total in plan.per_node.items():
        mine = [rp for rp in plan.ranks if rp.rank >= 0 and plan.node_of.get(rp.rank) == node]
        who = []
        for role in ("trainer", "rollout"):
            ks = [rp.rank for rp in mine if rp.role == role]
            if ks:
                who.append(f"{len(ks)} {role} (rank{f's {ks[0]}-{ks[-1]}' if len(ks) > 1 else f' {ks[0]}'})")
        lines.append(f"node {node}: {f(total)} {unit} on its {what}; {', '.join(who)}")
    sent = ", ".join(f"node {n} sends {f(b)}" for n, b in plan.update_sent_by_node.items()) or "nothing"
    lines.append(
        f"weight update ({plan.sharding}): {f(plan.update_cross_bytes)} {unit} between nodes ({sent} {unit}); "
        f"each rollout rank copies its own node's pieces locally"
    )
    return lines


def notes(plan) -> str:
    """What each column holds, once per distinct note, with the ranks it applies to."""
    seen: dict[str, list[int]] = {}
    for rp in plan.ranks:
        for n in rp.notes:
            seen.setdefault(n, []).append(rp.rank)
    return "\n".join(f"  ranks {','.join(map(str, ranks))}: {n}" for n, ranks in seen.items())


def summary(plan) -> dict:
    """The last line of ``python -m staleflow plan``."""
    worst = max(plan.per_gpu.values(), default=max((rp.peak for rp in plan.ranks), default=0))
    kv = {rp.rank: rp.items.get("kv_cache", 0) for rp in plan.ranks if rp.role == "rollout"}
    return {
        "fits": plan.fits,
        "max_gpu_gib": round(worst / GiB, 2),
        "gpu_gib": round(plan.gpu_bytes / GiB, 2) if plan.device_type == "cuda" else None,
        "device": plan.device_type,
        "model": plan.model,
        "params_b": round(plan.params / 1e9, 3),
        "active_params_b": round((plan.active_params or plan.params) / 1e9, 3),
        "ranks": sum(rp.role != "reward" for rp in plan.ranks),
        "trainer_ranks": sum(rp.role == "trainer" for rp in plan.ranks),
        "reward_model_gib": round(sum(rp.peak for rp in plan.ranks if rp.role == "reward") / GiB, 2),
        "rollout_ranks": len(kv),
        "per_gpu_gib": {str(g): round(n / GiB, 2) for g, n in sorted(plan.per_gpu.items())},
        "kv_cache_gib": round(max(kv.values(), default=0) / GiB, 2),
        "kv_tokens": plan.kv_tokens,
        "engine": plan.engine,
        "engine_gpu_share": {str(r): u for r, u in plan.gpu_share.items()},
        "advice": "" if plan.fits else advice(plan),
    } | (
        {
            "nodes": plan.nodes,
            "sharding": plan.sharding,
            "per_node_gib": {str(n): round(b / GiB, 2) for n, b in plan.per_node.items()},
            "update_cross_node_gib": round(plan.update_cross_bytes / GiB, 3),
            "update_sent_by_node_gib": {str(n): round(b / GiB, 3) for n, b in plan.update_sent_by_node.items()},
        }
        if plan.nodes > 1
        else {}
    )


def json_line(plan) -> str:
    return json.dumps(summary(plan))


def advice(plan) -> str:
    """One line: the worst GPU, what overflows it and the flag to change."""
    if plan.fits:
        return ""
    gpu, used = max(plan.per_gpu.items(), key=lambda kv: kv[1])
    over = used - plan.gpu_bytes
    on_gpu = [rp for rp in plan.ranks if rp.gpu == gpu]
    rp = max(on_gpu, key=lambda r: r.peak)
    where = (
        f"memory plan: GPU {gpu} needs {_g(used)} GiB of {_g(plan.gpu_bytes)} GiB "
        f"(ranks {', '.join(f'{r.rank} {r.role}' for r in on_gpu)})"
    )
    kv = rp.items.get("kv_cache", 0)
    if any(r.role == "reward" for r in on_gpu):
        return f"{where}; put the reward model elsewhere (--reward.model-device) or lower --reward.model-batch-size"
    if rp.role == "rollout" and kv > over:
        fit = int(plan.kv_tokens * (kv - over * 1.1) / kv) // 1024 * 1024
        return f"{where}; lower --rollout.max-kv-tokens from {plan.kv_tokens} to {fit} or less"
    if rp.load_peak > rp.steady:
        more = (
            "use more trainer ranks (raise --nproc_per_node or lower --rollout.ranks) or "
            if rp.role == "trainer"
            else "use "
        )
        return f"{where}; loading the weights needs {_g(rp.load_peak)} GiB on one GPU: {more}GPUs with more memory"
    if rp.role == "trainer" and "activation checkpointing off" in " ".join(rp.notes):
        return f"{where}; set --train.activation-checkpointing on"
    if rp.role == "trainer" and rp.items.get("activations", 0) > over * 2:
        return f"{where}; lower --train.micro-batch-tokens (activations: {_g(rp.items['activations'])} GiB)"
    if rp.role == "trainer":
        return f"{where}; shard over more trainer ranks: raise --nproc_per_node or lower --rollout.ranks"
    return f"{where}; lower --rollout.max-running or --rollout.prefill-chunk-tokens"
