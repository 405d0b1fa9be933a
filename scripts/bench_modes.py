"""The real runtime on CPU: StaleFlow and the baselines at matched eta on a skewed workload, and the
simulator fed the cost model measured here, against the measured throughput of each mode.

    python scripts/bench_modes.py [--steps 8] [--eta 2] [--length-dist lognormal:96:1.0] [--max-new 512]

1. Measure: the decode cost model of the rollout engine on this machine (scripts/fit_cost_model.py, one
   thread per rank as under torchrun) and its prefill rate (prefill steps of the same engine).
2. Run: each mode (verl-sync, verl-one-step-off, verl-fully-async, areal, pipelinerl, pipelinerl-reserve,
   staleflow: by default with tail lanes and KV kept across a pull, as the PipelineRL peer keeps it) is the real system
   (torchrun: 1 trainer + 2 rollout ranks + controller) on the same prompts, seeds and long-tailed
   response lengths (--rollout.length-dist: each trajectory's length is drawn, eos ignored), with the
   measured cost model in its router. Throughput counts what the trainer consumed: trained response
   tokens per second from the end of step --warmup to the end of the last step.
3. Simulate: the same modes in the simulator (the same controller loop over sim/backend.py), fed the
   measured decode cost model and prefill rate, the trainer's step time per token as measured in that
   mode's runs (on a shared machine the trainer's CPU share changes with the load, so it is an input,
   not a prediction), the measured push and pull times, and the CPU sharing of the ranks
   (--shared-cores: an instance with work decodes busy/cores times slower while the trainer or the
   other instance is busy). What the simulator predicts is how the rollout side and the schedule
   compose: generation time, overlap, waits.
Each mode runs --repeats times, interleaved (mode order rotates), and the mean is reported: the
2-core machine is shared, and the load drifts over minutes.
Prints the hardware, the table (baselines measured in the same run, ratios) and, last, one JSON line:
{"staleflow_vs_best_async", "best_async", "staleflow_vs_pipelinerl", "<mode>_tok_s", "<mode>_vs_sync", "<mode>_sim_err",
"sim_vs_real_max_err", "load_start", "load_end"}. Speculative decoding: --speculative-flags are given to every run
(the engine's flags, docs/engine.md) and --sim-spec-accept to the simulated twin (tokens per verify forward).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from staleflow.metrics.hardware import cpu_name

MODES = ["verl-sync", "verl-one-step-off", "verl-fully-async", "areal", "pipelinerl", "pipelinerl-reserve", "staleflow"]
ASYNC = ["verl-one-step-off", "verl-fully-async", "areal", "pipelinerl", "pipelinerl-reserve"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure_cost_model(args, root: str) -> tuple[str, float]:
    """(path of the fitted cost-model JSON, prefill tokens/s) of the rollout engine on this machine."""
    out, samples = os.path.join(root, "cost.json"), os.path.join(root, "samples.jsonl")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "fit_cost_model.py"),
        "--model",
        args.model,
        "--threads",
        "1",
        "--batches",
        "1,4,8,16,32",
        "--prompt-lens",
        "32,256",
        "--kv-capacity",
        str(args.kv_tokens),
        "--save-samples",
        samples,
        "--out",
        out,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0:
        raise SystemExit(f"cost-model profiling failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return out, measure_prefill(args)


def measure_prefill(args) -> float:
    """Prefill tokens/s of the built-in engine, one thread (as each torchrun rank): prompts of 64-256
    tokens, the step that prefills them (what a resumed partial trajectory also pays to recompute KV)."""
    import torch

    from staleflow.model import load_model
    from staleflow.rollout.builtin_engine import BuiltinEngine
    from staleflow.rollout.engine import Request, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        tokens = seconds = 0.0
        for plen in (64, 128, 256, 256, 128, 64):
            eng = BuiltinEngine(
                model,
                max_running=4,
                max_kv_tokens=args.kv_tokens,
                block_size=16,
                prefill_chunk_tokens=4 * plen,
                max_model_len=plen + 4,
                profile=True,
            )
            for r in range(4):
                ids = torch.randint(100, model.args.vocab_size, (plen,), generator=gen).tolist()
                eng.add(Request(r, ids, SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)))
            while eng.has_unfinished():
                eng.step()
            for smp in eng.profile_samples:
                if smp.prefill_tokens > 0:
                    tokens, seconds = tokens + smp.prefill_tokens, seconds + smp.latency_s
    finally:
        torch.set_num_threads(threads)
    return tokens / seconds


def run_mode(mode: str, args, root: str, cost_json: str, rep: int = 0) -> dict:
    name = f"bench-{mode}-{rep}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=3",
        "-m",
        "staleflow",
        "train",
        "--preset",
        "tiny",
        "--model.path",
        args.model,
        "--mode",
        mode,
        "--steps",
        str(args.steps),
        "--rollout.length-dist",
        args.length_dist,
        "--rollout.max-new-tokens",
        str(args.max_new),
        "--rollout.max-model-len",
        str(args.max_new + 256),
        "--rollout.max-kv-tokens",
        str(args.kv_tokens),
        "--staleness.batch-size",
        str(args.batch),
        "--staleness.group-size",
        str(args.group),
        "--staleness.eta",
        str(args.eta),
        "--coordinator.cost-model",
        cost_json,
        "--log.run-dir",
        root,
        "--log.name",
        name,
        "--log.no-progress",
        "--log.no-plot",
        "--log.no-tensorboard",
        "--checkpoint.no-export-hf",
        "--seed",
        str(args.seed),
        *args.extra,
        *args.speculative_flags.split(),
        *mode_flags(mode, args),
    ]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-15:])
        raise SystemExit(f"mode {mode} failed (exit {res.returncode}):\n{tail}")
    run_dir = os.path.join(root, name)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "timeline.jsonl")) as f:
        spans = [json.loads(line) for line in f if line.strip()]
    w = args.warmup
    first, rest = rows[w - 1], rows[w:]
    span = rest[-1]["time"] - first["time"]
    pulls = [s["t1"] - s["t0"] for s in spans if s["kind"] == "pull"]
    return {
        "mode": mode,
        "steps": len(rows),
        "wall_s": wall,
        "measured_s": span,
        "tokens_per_s": sum(r["trained_tokens"] for r in rest) / span,
        "staleness_mean": sum(r["staleness_mean"] * r["trained_groups"] for r in rest)
        / max(1, sum(r["trained_groups"] for r in rest)),
        "over_eta": rows[-1].get("over_eta", 0),
        "interrupts": rows[-1]["interrupts"],
        "pulls": rows[-1]["pulls"],
        "train": [(r["trained_tokens"], r["trained_trajectories"], r["train_s"]) for r in rows],
        "push_s": sum(r["push_s"] for r in rows) / len(rows),
        "pull_s": sum(pulls) / max(1, len(pulls)),
    }


def prompt_len(args) -> int:
    from staleflow.data import PromptSource
    from staleflow.model import load_tokenizer, resolve_model_path
    from staleflow.presets import PRESETS

    cfg = PRESETS["tiny"]()
    src = PromptSource(cfg.data, load_tokenizer(resolve_model_path(args.model)))
    lens = [len(next(src).prompt_ids) for _ in range(64)]
    return round(sum(lens) / len(lens))


def train_fit(steps: list[tuple[int, int, float]], prompt_len: int) -> tuple[float, float]:
    """(seconds per token, seconds per step) of the trainer: least squares over (tokens, train_s) of the steps."""
    toks = [t + n_traj * prompt_len for t, n_traj, _ in steps]
    n = len(steps)
    mx, my = sum(toks) / n, sum(s for _, _, s in steps) / n
    slope = sum((x - mx) * (s - my) for x, (_, _, s) in zip(toks, steps)) / max(1e-9, sum((x - mx) ** 2 for x in toks))
    if slope <= 0:  # too noisy to separate the two: all of it per token
        return my / mx, 0.0
    return slope, max(0.0, my - slope * mx)


def mode_flags(mode: str, args) -> list[str]:
    """The flags of one mode only: --staleflow-flags, --verl-flags (verl-fully-async), --areal-flags,
    --pipelinerl-flags."""
    own = {
        "staleflow": args.staleflow_flags,
        "verl-fully-async": args.verl_flags,
        "areal": args.areal_flags,
        "pipelinerl": args.pipelinerl_flags,
    }
    return own.get(mode, "").split()


def peer_of(mode: str, args) -> dict | None:
    """The mode's own knobs its flags set (--peer.<mode>.<knob> ...), for the simulator's run: parsed by the run's
    own config parser, so the simulator gets exactly the Settings the runtime ran with."""
    import dataclasses

    from staleflow.config import RunConfig
    from staleflow.config.parse import parse
    from staleflow.modes import mode_of, mode_settings
    from staleflow.presets import PRESETS

    flags = mode_flags(mode, args)
    if not any(f.startswith("--peer.") for f in flags) or mode_of(mode).Settings is None:
        return None
    cfg = parse(RunConfig, ["--mode", mode, *flags], PRESETS, default="tiny", prog="bench_modes")
    return dataclasses.asdict(mode_settings(mode, cfg.peer))


def simulate(mode: str, args, cost_json: str, prefill: float, runs: list[dict], everything: list[dict]) -> float:
    """Simulated trained tokens/s of `mode` on the runtime's shape, with everything measured above."""
    from staleflow.config import StalenessConfig
    from staleflow.coordinator.cost_model import load_cost_model
    from staleflow.sim.config import SimConfig
    from staleflow.sim.simulator import run

    slope, overhead = train_fit([s for r in runs for s in r["train"][1:]], args.prompt_len)
    median, sigma = (float(x) for x in args.length_dist.split(":")[1:])
    pull = sum(m["pull_s"] for m in everything) / len(everything)
    push = sum(m["push_s"] for m in everything) / len(everything)
    cfg = SimConfig(
        total_gpus=3,
        rollout_gpus=2,
        gpus_per_instance=1,
        cost_model=cost_json,
        kv_capacity=args.kv_tokens,
        prefill_tokens_per_s=prefill,
        max_running=args.max_running,
        train_tokens_per_gpu_s=1.0 / slope,
        train_overhead_s=overhead,
        push_s=push,
        pull_s=pull,
        broadcast_s=pull,
        colocated_switch_s=0.0,
        staleness=StalenessConfig(batch_size=args.batch, group_size=args.group),
        prompt_len=args.prompt_len,
        response_median=median,
        response_sigma=sigma,
        max_response=args.max_new,
        steps=args.steps,
        warmup_steps=args.warmup,
        tick_s=0.01,
        router_fit_samples=0,
        shared_cores=args.shared_cores,
        colocated_sync=False,
        seed=args.seed,
        out_dir="",
        ablation=False,
        spec_accept=args.sim_spec_accept,
    )
    # What the runtime runs: StaleFlow keeps KV across a pull and opens tail lanes only when its flags say so (both
    # are off by default in the runtime, on in the simulator's own default); a peer's mode sets its own.
    flags = args.staleflow_flags.split() if mode == "staleflow" else []
    overrides = {}
    if mode == "staleflow":
        overrides = {k: f"--coordinator.{k.replace('_', '-')}" in flags for k in ("keep_kv_on_pull", "tail_lanes")}
        # the runtime's pull policy (status unless the flags say; the simulator's own default is greedy)
        overrides["pull"] = flags[flags.index("--coordinator.pull") + 1] if "--coordinator.pull" in flags else "status"
    if "--coordinator.mu" in flags:
        overrides["mu"] = float(flags[flags.index("--coordinator.mu") + 1])
    return run(cfg, mode, args.eta, overrides, cost=load_cost_model(cost_json), peer=peer_of(mode, args)).tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (interleaved); the mean is reported")
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from the measurement")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--length-dist", default="lognormal:96:1.0")
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--kv-tokens", type=int, default=8192, help="engine KV capacity (the tiny preset's)")
    ap.add_argument("--max-running", type=int, default=64, help="engine running cap (RolloutConfig default)")
    ap.add_argument("--batch", type=int, default=4, help="prompt groups per step (B)")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt (N)")
    ap.add_argument("--eta", type=int, default=2, help="staleness bound (verl-sync: 0, verl-one-step-off: 1)")
    ap.add_argument("--shared-cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--keep", default="", help="keep the run folders here (default: a temporary folder)")
    ap.add_argument(
        "--staleflow-flags",
        default="--coordinator.mu 0 --coordinator.tail-lanes --coordinator.keep-kv-on-pull",
        help="flags for the staleflow mode only. Default mu 0: the CPU cost curve is compute-bound from "
        "n = 1, so the GPU default mu 0.2 makes the waterfall hold work back (2-3 trajectories per "
        "instance), which keeps the rollout ranks busy and slows the trainer sharing their cores; tail lanes; "
        "KV kept across a pull (the PipelineRL peer's in-flight update keeps it too)",
    )
    ap.add_argument(
        "--speculative-flags",
        default="",
        help="engine flags for speculative decoding, given to every mode's runs (e.g. the built-in engine's "
        "--rollout.speculative* flags, docs/engine.md); '' (default): one token per step",
    )
    ap.add_argument(
        "--sim-spec-accept",
        type=float,
        default=1.0,
        help="the simulated twin's tokens per verify forward (sim/speculative.py; 1: off, as the runs without "
        "--speculative-flags); give the acceptance the engine measured (scripts/bench_speculative.py, issue 49)",
    )
    ap.add_argument(
        "--verl-flags",
        default="",
        help="flags for verl-fully-async only, e.g. the grid's guarantee-matched peer at eta 2: "
        "'--peer.verl-fully-async.staleness-threshold 0 --peer.verl-fully-async.trigger-sync-steps 3'",
    )
    ap.add_argument(
        "--areal-flags", default="", help="flags for areal only, e.g. '--peer.areal.max-concurrent-rollouts 8'"
    )
    ap.add_argument(
        "--pipelinerl-flags", default="", help="flags for pipelinerl only, e.g. '--peer.pipelinerl.lag-groups 4'"
    )
    ap.add_argument("extra", nargs="*", help="more flags for every run (after --)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if args.steps < args.warmup + 3 or "verl-sync" not in modes or args.repeats < 1:
        raise SystemExit("need --steps >= --warmup + 3, --repeats >= 1 and verl-sync among --modes (the baseline)")
    args.prompt_len = prompt_len(args)
    with tempfile.TemporaryDirectory(prefix="staleflow-bench-") as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        cost_json, prefill = measure_cost_model(args, root)
        with open(cost_json) as f:
            cost = json.load(f)
        load0 = os.getloadavg()[0]
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            for m in order:
                runs[m].append(run_mode(m, args, root, cost_json, rep))
        everything = [r for rs in runs.values() for r in rs]
        sim = {m: simulate(m, args, cost_json, prefill, runs[m], everything) for m in modes}
    measured = {
        m: {
            k: sum(r[k] for r in rs) / len(rs)
            for k in ("tokens_per_s", "staleness_mean", "over_eta", "interrupts", "pulls", "wall_s")
        }
        for m, rs in runs.items()
    }
    base = measured["verl-sync"]["tokens_per_s"]
    print(
        f"# machine: {cpu_name()}, {os.cpu_count()} cores, load {load0:.1f} -> {os.getloadavg()[0]:.1f} (shared), "
        f"python {platform.python_version()}; 3 ranks (1 trainer + 2 rollout) share the cores"
    )
    print(
        "# per run tok/s: "
        + "; ".join(f"{m} " + ", ".join(f"{r['tokens_per_s']:.0f}" for r in rs) for m, rs in runs.items())
    )
    print(
        f"# workload: {args.model}, B={args.batch} groups x N={args.group}, prompts {args.prompt_len} tokens, lengths "
        f"{args.length_dist} capped at {args.max_new}, eta={args.eta}, {args.steps} steps (first {args.warmup} excluded)"
    )
    print(f"# staleflow flags: {args.staleflow_flags or '(none)'}; every mode: {' '.join(args.extra) or '(none)'}")
    print(
        f"# measured cost model: k1={cost['k1']:.3g} k2={cost['k2']:.3g} k3={cost['k3']:.3g} b3={cost['b3']:.3g} "
        f"(fit mean err {cost['fit']['mean_rel_err']:.0%}), prefill {prefill:.0f} tok/s"
    )
    print(
        f"{'mode':<19}{'tok/s':>8}{'vs sync':>9}{'staleness':>11}{'>eta':>6}{'intr':>6}{'pulls':>7}{'wall s':>8}"
        f"{'sim tok/s':>11}{'sim err':>9}"
    )
    out: dict = {}
    for m in modes:
        r = measured[m]
        err = sim[m] / r["tokens_per_s"] - 1.0
        key = m.replace("-", "_")
        out[f"{key}_tok_s"] = round(r["tokens_per_s"], 2)
        out[f"{key}_vs_sync"] = round(r["tokens_per_s"] / base, 3)
        out[f"{key}_sim_err"] = round(err, 3)
        print(
            f"{m:<19}{r['tokens_per_s']:>8.1f}{r['tokens_per_s'] / base:>9.2f}{r['staleness_mean']:>11.2f}"
            f"{r['over_eta']:>6.0f}{r['interrupts']:>6.0f}{r['pulls']:>7.0f}{r['wall_s']:>8.0f}{sim[m]:>11.1f}"
            f"{err:>+9.1%}"
        )
    best = max((m for m in modes if m in ASYNC), key=lambda m: measured[m]["tokens_per_s"], default=None)
    if "staleflow" in modes and best:
        out["best_async"] = best
        out["staleflow_vs_best_async"] = round(
            measured["staleflow"]["tokens_per_s"] / measured[best]["tokens_per_s"], 3
        )
    for peer in ("pipelinerl", "pipelinerl-reserve"):
        if "staleflow" in modes and peer in modes:
            key = f"staleflow_vs_{peer.replace('-', '_')}"
            out[key] = round(measured["staleflow"]["tokens_per_s"] / measured[peer]["tokens_per_s"], 3)
    out["load_start"], out["load_end"] = round(load0, 2), round(os.getloadavg()[0], 2)
    out["sim_vs_real_max_err"] = round(max(abs(out[f"{m.replace('-', '_')}_sim_err"]) for m in modes), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
