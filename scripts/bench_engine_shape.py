"""The built-in engine at a real model's shape with random weights: paged kernel vs gather, the paged
kernel with and without CUDA graphs, set beside the memory plan's rollout row.

    python scripts/bench_engine_shape.py                      # GPU: Qwen2.5-7B shape, bf16, 64 x (1024 + 256)
    python scripts/bench_engine_shape.py --device cpu --hidden 64 --layers 2 --batch 4 --prompt 16 --new-tokens 8

No checkpoint is read (random bf16 weights, made on the device): the shapes, the KV cache and the
kernels are the real ones. For each configuration (decode backend, CUDA graphs) the same greedy
requests run to --new-tokens (eos ignored); reported per configuration: prefill seconds, decode ms
per step (median over the steps where every sequence decodes), decode tokens/s, peak allocated
memory, and the plan's rollout row (without the CUDA context, which torch does not count). The first
configuration is the baseline of the ratios. Last line: JSON.

Configurations (--configs, a comma list of BACKEND or BACKEND+graphs): by default, on CUDA,
``triton,triton+graphs,gather`` (graphs only where ``check_cuda_graphs`` accepts them: never on
gather); on CPU ``gather,mirror``. Before anything is built every configuration is resolved and
validated by the engine's own checks (``validate_configs``); ``--validate`` stops there, without a
GPU: scripts/device_check.sh --dry-run runs the step's exact command with it. After each
configuration the engine is released (its KV cache and graph pool freed: gc + empty_cache) and the
memory still allocated is recorded (``left_gib``) before the next one is built.

``--cost-samples FILE`` then profiles the first configuration over a sweep of cells (``--cost-cells``,
n sequences x prompt tokens, ``--cost-decode-steps`` each; no cell starts after ``--cost-budget-s``)
and writes every engine step to FILE in the cost-samples format (staleflow/sim/cost_samples.py), which
``scripts/fit_cost_model.py --samples FILE --profile <gpu>`` refits (device check step 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time

import torch

GiB = 2**30


def build_model(args, device: str, dtype: torch.dtype, seed: int = 0):
    """Our CausalLM made on ``device`` in ``dtype`` with normal(0, 0.02) matrices (no host copy)."""
    from staleflow.model import CausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(args)
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def plan_row(args, rc, device: str) -> dict:
    from staleflow.config import RunConfig
    from staleflow.plan.estimate import rollout_rank

    plan = rollout_rank(RunConfig(rollout=rc), args, 0, device)
    items = {k: round(v / GiB, 3) for k, v in plan.items.items()}
    return {"items_gib": items, "gib_without_contexts": round((plan.steady - plan.items.get("contexts", 0)) / GiB, 3)}


def parse_configs(text: str) -> list[tuple[str, bool]]:
    """ "triton,triton+graphs,gather" -> [("triton", False), ("triton", True), ("gather", False)]."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        backend, _, extra = item.partition("+")
        if extra not in ("", "graphs"):
            raise SystemExit(f"--configs: {item!r} is invalid: use BACKEND or BACKEND+graphs")
        out.append((backend, extra == "graphs"))
    return out


def default_configs(device: str) -> str:
    return "triton,triton+graphs,gather" if device == "cuda" else "gather,mirror"


def validate_configs(configs, margs, rc, device: str) -> list[str]:
    """Every configuration through the checks the engine applies when it is built on ``device``
    (none of which needs the device): the rollout config, the decode backend's name and, with CUDA
    graphs, ``check_cuda_graphs``. Returns the list of errors (one line each)."""
    from staleflow.rollout.cuda_graphs import check_cuda_graphs
    from staleflow.rollout.decode_backend import DECODE_BACKENDS
    from staleflow.rollout.engine import EngineError

    errors = []
    for backend, graphs in configs:
        name = f"{backend}{'+graphs' if graphs else ''}"
        try:
            if backend not in DECODE_BACKENDS or backend == "auto":
                raise EngineError(f"decode backend {backend!r} is unknown: use one of {list(DECODE_BACKENDS[1:])}")
            if backend == "mirror" and device == "cuda":
                raise EngineError("the mirror decode backend is the CPU path: use triton or gather on CUDA")
            dataclasses.replace(rc, decode_backend=backend, cuda_graphs=graphs)  # RolloutConfig validation
            if graphs:
                check_cuda_graphs(torch.device(device), backend, margs)
        except (EngineError, ValueError) as e:
            errors.append(f"{name}: {e}")
    return errors


def release(engine) -> None:
    """Free an engine's KV cache, decode graphs and their memory pool now, not at the next gc."""
    runner = engine.runner
    if runner.graphs is not None:
        runner.graphs.release()
    runner.graphs = None
    runner.attn.k_cache = runner.attn.v_cache = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_config(model, args, rc, prompts, new_tokens: int, backend: str, graphs: bool, device: str) -> dict:
    from staleflow.rollout.builtin_engine import BuiltinEngine
    from staleflow.rollout.engine import Request, SamplingParams

    kwargs = {"cuda_graphs": True} if graphs else {}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine = BuiltinEngine(
        model,
        max_running=rc.max_running,
        max_kv_tokens=rc.max_kv_tokens,
        block_size=rc.block_size,
        prefill_chunk_tokens=rc.prefill_chunk_tokens,
        max_model_len=rc.max_model_len,
        decode_backend=backend,
        prefix_sharing=False,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(Request(i, p, params))
    outs, decode_steps, t_start = {}, [], time.perf_counter()
    prefill_s = None
    while engine.has_unfinished():
        t0 = time.perf_counter()
        before = engine.tokens_generated
        for o in engine.step():
            outs[o.request_id] = o.tokens.response_ids
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if engine.tokens_generated - before == len(prompts):  # every sequence sampled this step
            if prefill_s is None:  # the first such step still ran prefill: it ends the prefill phase
                prefill_s = time.perf_counter() - t_start
            else:
                decode_steps.append(dt)
    total_s = time.perf_counter() - t_start
    ms = statistics.median(decode_steps) * 1e3 if decode_steps else float("nan")
    peak = round(torch.cuda.max_memory_allocated() / GiB, 3) if cuda else None
    release(engine)
    del engine
    return {
        "backend": backend,
        "cuda_graphs": graphs,
        "prefill_s": round(prefill_s or 0.0, 3),
        "decode_ms_per_step": round(ms, 3),
        "decode_tok_s": round(len(prompts) * 1e3 / ms, 1) if decode_steps else 0.0,
        "total_s": round(total_s, 3),
        "peak_gib": peak,
        "left_gib": round(torch.cuda.memory_allocated() / GiB, 3) if cuda else None,  # the model's weights only
        "tokens": [outs[i] for i in range(len(prompts))],
    }


def cost_sweep_cells(args, margs, errors: list[str]) -> list | None:
    """--cost-samples' cells (parse_cells of scripts/fit_cost_model.py), checked without a device: they parse and their
    KV fits the model's context; a problem is appended to ``errors``."""
    if not args.cost_samples:
        return None
    from fit_cost_model import parse_cells

    default = (
        "1x64,16x2048,256x64,8x64,32x64,128x64,48x2048"
        if args.device == "cuda"
        else "1x32,4x32,16x32,48x32,4x256,16x256"
    )
    try:
        cells = parse_cells(args.cost_cells or default, args.cost_decode_steps)
    except ValueError as e:
        errors.append(f"--cost-cells: {e}")
        return None
    longest = max(p + d for _, p, d in cells) + 16
    if longest > margs.max_position_embeddings:
        errors.append(f"--cost-cells: a {longest}-token sequence exceeds the model's {margs.max_position_embeddings}")
    return cells


def record_sweep(model, args, config, cells) -> dict:
    """The cost-model sweep on the first configuration; an error is a result, the benchmark's numbers stand."""
    from fit_cost_model import record_cost_samples

    backend, graphs = config
    try:
        return record_cost_samples(model, args.cost_samples, cells, model_name=args.model, backend=backend,
                                   graphs=graphs, budget_s=args.cost_budget_s,
                                   source="scripts/bench_engine_shape.py --cost-samples")  # fmt: skip
    except Exception as e:
        return {"path": args.cost_samples, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-7B-Instruct", help="architecture (bundled name, alias or folder)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--configs", default="", help="BACKEND[+graphs],... (default: triton,triton+graphs,gather on CUDA)")
    ap.add_argument("--validate", action="store_true", help="resolve and validate the configurations, build nothing")
    ap.add_argument("--hidden", type=int, default=0, help="shrink the model (CPU smoke): hidden size")
    ap.add_argument("--layers", type=int, default=0, help="shrink the model: decoder layers")
    ap.add_argument("--cost-samples", default="", help="then write a cost-model sweep's steps here (JSON lines)")
    ap.add_argument("--cost-cells", default="", help="SEQUENCESxPROMPT,... (default: 7 cells up to 256 sequences "
                    "and 48 x 2048 prompt tokens on CUDA, up to 48 x 256 on CPU)")  # fmt: skip
    ap.add_argument("--cost-decode-steps", type=int, default=8)
    ap.add_argument("--cost-budget-s", type=float, default=25.0, help="no sweep cell starts after this long")
    args = ap.parse_args()
    from staleflow.config import RolloutConfig
    from staleflow.plan.architecture import model_args

    margs = model_args(args.model)
    if args.hidden:
        margs = dataclasses.replace(
            margs, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_heads=4, num_kv_heads=2,
            head_dim=args.hidden // 4, vocab_size=min(margs.vocab_size, 1024),
        )  # fmt: skip
    if args.layers:
        margs = dataclasses.replace(margs, num_layers=args.layers)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    block = 16
    max_len = args.prompt + args.new_tokens + block
    rc = RolloutConfig(
        max_running=args.batch,
        max_kv_tokens=args.batch * max_len,
        block_size=block,
        prefill_chunk_tokens=min(8192, args.batch * args.prompt),
        max_model_len=max_len,
    )
    configs = parse_configs(args.configs or default_configs(args.device))
    errors = validate_configs(configs, margs, rc, args.device)
    names = [f"{b}{'+graphs' if g else ''}" for b, g in configs]
    cost_cells = cost_sweep_cells(args, margs, errors)
    if cost_cells:
        from fit_cost_model import kv_tokens_needed

        kv = kv_tokens_needed(cost_cells, block)
        kv_gib = kv * margs.num_layers * 2 * margs.num_kv_heads * margs.head_dim * (2 if cuda else 4) / GiB
        names.append(f"cost-samples {len(cost_cells)} cells ({kv} KV tokens, {kv_gib:.1f} GiB)")
    if args.validate or errors:
        print(json.dumps({"validated": names, "device": args.device, "errors": errors, "ok": not errors}))
        for e in errors:
            print(f"bench_engine_shape: configuration {e}", file=sys.stderr)
        return 2 if errors else 0
    t0 = time.perf_counter()
    model = build_model(margs, args.device, dtype)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, margs.vocab_size, (args.batch, args.prompt), generator=g).tolist()
    runs = []
    for backend, graphs in configs:
        try:
            runs.append(run_config(model, margs, rc, prompts, args.new_tokens, backend, graphs, args.device))
        except Exception as e:  # one configuration failing is a result, not the end of the table
            runs.append({"backend": backend, "cuda_graphs": graphs, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    cost = record_sweep(model, args, configs[0], cost_cells) if cost_cells else None
    base = next((r for r in runs if "error" not in r), None)
    plan = plan_row(margs, rc, args.device)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"{name}; {args.model} shape: {margs.num_layers} layers, hidden {margs.hidden_size}, {dtype}; "
          f"{args.batch} x ({args.prompt} prompt + {args.new_tokens} new), block {block}; model built in {build_s:.1f} s")  # fmt: skip
    print(f"{'backend':<8} {'graphs':<12} {'prefill s':>9} {'ms/step':>8} {'tok/s':>9} {'vs base':>7} {'peak GiB':>8}")
    for r in runs:
        if "error" in r:
            print(f"{r['backend']:<8} {str(r['cuda_graphs']):<12} error: {r['error']}")
            continue
        ratio = r["decode_tok_s"] / base["decode_tok_s"] if base and base["decode_tok_s"] else float("nan")
        r["tok_s_vs_base"] = round(ratio, 3)
        r["agree_with_base"] = round(
            sum(a == b for x, y in zip(r["tokens"], base["tokens"]) for a, b in zip(x, y))
            / max(1, sum(len(x) for x in base["tokens"])),
            4,
        )
        print(f"{r['backend']:<8} {str(r['cuda_graphs']):<12} {r['prefill_s']:>9.2f} {r['decode_ms_per_step']:>8.2f} "
              f"{r['decode_tok_s']:>9.0f} {ratio:>7.2f} {r['peak_gib'] if r['peak_gib'] is not None else '-':>8}")  # fmt: skip
    print(f"plan (rollout row, no CUDA context): {plan['gib_without_contexts']} GiB")
    for r in runs:
        r.pop("tokens", None)
    peaks = [r["peak_gib"] for r in runs if r.get("peak_gib") is not None]
    out = {
        "device": name,
        "shape": {"layers": margs.num_layers, "hidden": margs.hidden_size, "vocab": margs.vocab_size},
        "batch": args.batch,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "configs": names,
        "runs": runs,
        "plan_gib": plan["gib_without_contexts"],
        "peak_gib": max(peaks) if peaks else None,
        "peak_vs_plan": round(max(peaks) / plan["gib_without_contexts"], 3) if peaks else None,
        "ok": bool(runs) and all("error" not in r and r["decode_tok_s"] > 0 for r in runs),
    }
    if cost is not None:
        out["cost_samples"] = cost
        out["ok"] = out["ok"] and "error" not in cost
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
