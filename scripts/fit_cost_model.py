"""Profile the built-in engine and fit the decode cost model latency = k1*KV + max(k2, k3*n + b3).

    python scripts/fit_cost_model.py                                   # SmolLM2-135M on this machine
    python scripts/fit_cost_model.py --out src/staleflow/coordinator/presets/cpu-smollm2.json
    python scripts/fit_cost_model.py --samples cost_samples.jsonl --profile h100   # refit a profile from a device run
    python scripts/fit_cost_model.py --samples cost_samples.jsonl --profile cpu --preset cpu-smollm2 --out /tmp/f.json

Samples: a cost-samples file (staleflow/sim/cost_samples.py: a header naming the device, GPU, model
shape, dtype and torch, then one JSON line per engine step). The device check's benchmark call writes
one (scripts/bench_engine_shape.py --cost-samples, step 8: $OUT/cost_samples.jsonl); without
--samples this script profiles the engine here through the same function (``record_cost_samples``):
one BuiltinEngine(profile=True) runs a sweep of cells (--batches x --prompt-lens: n sequences of one
prompt length, greedy, eos ignored, --decode-steps each) so n and KV vary independently.

The fit (staleflow.coordinator.fit_cost_model: relative residuals, soft-L1) uses the pure-decode
steps, the first of each cell dropped as warm-up. Printed: the coefficients, the fit error per step
(mean / max relative, R^2 of the latency), the prefill rate the prefill steps show, and a check that
the simulator reproduces the run: each cell replayed on a simulated instance (sim/engine.SimInstance,
the refitted cost model, no noise) against the cell's measured decode seconds.

--profile P (h20, h100, h200, cpu: sim/hardware.REFIT_PROFILES) writes the refitted preset where the
simulator reads it (sim/hardware.refit_name: presets/<preset>-<P>.json, or the preset itself where it
is P's own fit); --preset defaults to the one of the header's model (sim/hardware.preset_of_model).
The profile must be the one the samples were measured on. Output JSON: k1, k2, k3, b3, k4 = 0,
kv_capacity (--kv-capacity, else the refitted preset's, else the profiled engine's), model, dtype, hardware,
torch, date, fit. Last line: that JSON. A bad file or flag: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from staleflow.sim.cost_samples import CostSamplesError, SamplesHeader, SamplesWriter, Step, read_samples

# staleflow.coordinator (the fit, the presets) is imported where it is used: importing the package needs msgspec,
# which the device image lacks unless the prepared wheels are carried, and step 8 only records the samples

SOURCE = "scripts/fit_cost_model.py"


def kv_tokens_needed(cells, block: int) -> int:
    """KV tokens one cell at a time needs: n sequences of prompt + decode steps + 1, in whole blocks, + a block each."""
    return max(n * (math.ceil((p + d + 1) / block) + 1) * block for n, p, d in cells)


def record_cost_samples(model, path, cells, *, model_name: str, backend: str = "auto", graphs: bool = False,
                        block: int = 16, chunk: int = 8192, budget_s: float = 0.0, weights: str = "random",
                        tp: int = 1, source: str = SOURCE, seed: int = 0) -> dict:  # fmt: skip
    """Run the sweep on one BuiltinEngine(profile=True) over ``model`` and write its steps to ``path`` (the
    cost-samples format), cell by cell. ``cells``: (sequences, prompt tokens, decode steps). With
    ``budget_s`` no cell starts once the sweep has run that long (the rest are listed as skipped)."""
    import gc

    import torch

    from staleflow.metrics.hardware import cpu_name
    from staleflow.rollout.builtin_engine import BuiltinEngine
    from staleflow.rollout.engine import Request, SamplingParams

    p = next(model.parameters())
    cuda = p.device.type == "cuda"
    engine = BuiltinEngine(
        model,
        max_running=max(n for n, _, _ in cells),
        max_kv_tokens=kv_tokens_needed(cells, block),
        block_size=block,
        prefill_chunk_tokens=chunk,
        max_model_len=max(pl + d for _, pl, d in cells) + block,
        decode_backend=backend,
        prefix_sharing=False,  # shared prompt blocks would make KV attended cheaper than the cost model's KV
        cuda_graphs=graphs,
        profile=True,
    )
    header = SamplesHeader(
        device="cuda" if cuda else "cpu",
        gpu=torch.cuda.get_device_name(p.device) if cuda else None,
        cpu=cpu_name(),
        model=model_name,
        weights=weights,
        tp=tp,
        dtype=str(p.dtype).removeprefix("torch."),
        torch=torch.__version__,
        decode_backend=str(getattr(engine.runner, "backend", backend)),  # what "auto" resolved to
        cuda_graphs=graphs,
        block_size=block,
        max_kv_tokens=kv_tokens_needed(cells, block),
        prefill_chunk_tokens=chunk,
        cells=tuple(tuple(c) for c in cells),
        threads=torch.get_num_threads(),
        date=time.strftime("%Y-%m-%d"),
        load_average_1min=round(os.getloadavg()[0], 2),
        source=source,
    )
    writer = SamplesWriter(path, header)
    vocab = int(model.args.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    t0, rid, done, per_cell = time.perf_counter(), 0, [], []
    try:
        for i, (n, plen, steps) in enumerate(cells):
            if i and budget_s and time.perf_counter() - t0 > budget_s:  # the first cell always runs
                break
            start = len(engine.profile_samples)
            params = SamplingParams(temperature=0, max_new_tokens=steps + 1, ignore_eos=True)
            for _ in range(n):
                engine.add(Request(rid, torch.randint(0, vocab, (plen,), generator=gen).tolist(), params))
                rid += 1
            while engine.has_unfinished():
                engine.step()  # each step syncs (the sampled tokens come back), so its latency is the device's
            recs, seen_decode = [], False
            for s in engine.profile_samples[start:]:
                warm = s.prefill_tokens == 0 and not seen_decode
                seen_decode |= s.prefill_tokens == 0
                recs.append(Step(i, s, warm))
            writer.write(recs)
            done.append(i)
            dec = [r.sample.latency_s for r in recs if r.sample.prefill_tokens == 0 and not r.warmup]
            per_cell.append(round(sum(dec) / max(1, len(dec)) * 1e3, 3))
            print(f"cell {i}: n={n:4d} prompt={plen:5d}: {len(recs)} steps, decode {per_cell[-1]:8.2f} ms/step "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    finally:
        writer.close()
        engine.runner.attn.k_cache = engine.runner.attn.v_cache = None
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {
        "path": str(path),
        "cells_run": len(done),
        "cells_skipped": len(cells) - len(done),
        "steps": writer.steps,
        "decode_ms_per_cell": per_cell,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def parse_cells(text: str, decode_steps: int) -> list[tuple[int, int, int]]:
    """'1x64,16x2048' -> [(1, 64, steps), (16, 2048, steps)] (sequences x prompt tokens); ValueError if malformed."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        n, _, p = item.partition("x")
        if not (n.isdigit() and p.isdigit() and int(n) >= 1 and int(p) >= 1):
            raise ValueError(f"cell {item!r} is invalid: use SEQUENCESxPROMPT_TOKENS, e.g. 16x2048")
        out.append((int(n), int(p), decode_steps))
    if not out or decode_steps < 2:
        raise ValueError("give at least one cell and --decode-steps >= 2 (the first decode step of a cell is warm-up)")
    return out


def resolve_target(header: SamplesHeader, profile: str, preset: str) -> tuple[str, str, str]:
    """(profile, preset, preset file name) the refit writes; ValueError naming the fix."""
    from staleflow.coordinator.cost_model import preset_names
    from staleflow.sim.hardware import MODEL_SPECS, REFIT_PROFILES, preset_of_model, profile_of_device, refit_name

    measured = profile_of_device(header.device, header.gpu)
    if profile not in REFIT_PROFILES:
        raise ValueError(f"--profile {profile!r} is unknown: use one of {', '.join(REFIT_PROFILES)}")
    if measured != profile:
        on = header.gpu or "cpu"
        raise ValueError(
            f"the samples were measured on {on} (profile {measured or 'unknown'}), not {profile}: a profile is "
            f"refitted from its own hardware's samples; pass --profile {measured}"
            if measured
            else f"the samples were measured on {on}, which is none of the profiles: fit without --profile (--out F)"
        )
    inferred = preset_of_model(header.model, header.tp, profile)
    if preset and inferred and preset != inferred and (preset in MODEL_SPECS or preset.startswith("cpu-")):
        raise ValueError(
            f"the samples ran {header.model} at TP{header.tp}, whose preset is {inferred}, not {preset}: pass "
            f"--preset {inferred} (or none)"
        )
    preset = preset or inferred or ""
    if preset not in preset_names():
        raise ValueError(
            f"--preset {preset!r}: no cost-model preset for model {header.model!r} at TP{header.tp}; give one of "
            f"{', '.join(preset_names())}"
        )
    return profile, preset, refit_name(preset, profile)


def replay_trajectories(tail) -> list[tuple[int, int]] | None:
    """(context tokens at the first step, steps until it finishes) of each sequence of a run of consecutive
    pure-decode steps (CostSamples), from the steps alone: n running never grows, and the sequences that leave
    after step j hold KV_j - (KV_j+1 - n_j+1) tokens then (each survivor adds one a step). Chunked prefill
    starts a cell's sequences at different steps, so they also finish at different steps. None: not such a run."""
    out = []
    for j, s in enumerate(tail):
        n_next, kv_next = (tail[j + 1].n_running, tail[j + 1].kv_tokens) if j + 1 < len(tail) else (0, 0)
        leave = s.n_running - n_next
        ctx = s.kv_tokens - (kv_next - n_next)
        if leave < 0 or (leave == 0) != (ctx == 0) or (leave and ctx < leave * (j + 2)):
            return None
        q, r = divmod(ctx, leave) if leave else (0, 0)
        out += [(q + (m < r) - j, j + 1) for m in range(leave)]
    return out


def check_with_simulator(cost, header: SamplesHeader, steps: list[Step], prefill_rate: float) -> dict:
    """Each measured cell replayed on a simulated instance (the simulator's SimInstance, no noise, chunked prefill
    off so prefill and decode separate): its pure-decode steps after the last prefill (the warm-up dropped, as in
    the fit; the simulator has none) become simulated trajectories with the same contexts and finishing steps
    (replay_trajectories), whose decode seconds are set against the measured ones."""
    import dataclasses

    from staleflow.sim.engine import SimInstance, SimSequence

    rows, skipped = [], 0
    for i in sorted({s.cell for s in steps}):
        cell = [s for s in steps if s.cell == i]
        last_prefill = max((j for j, s in enumerate(cell) if s.sample.prefill_tokens), default=-1)
        tail = [s.sample for s in cell[last_prefill + 1 :] if not s.warmup]
        trajs = replay_trajectories(tail) if tail else None
        if not trajs:
            skipped += 1
            continue
        measured, tokens = sum(s.latency_s for s in tail), sum(t for t, _ in trajs)
        room = dataclasses.replace(cost, kv_capacity=max(cost.kv_capacity, tokens + len(trajs) * (len(tail) + 2)))
        inst = SimInstance(0, room, prefill_tokens_per_s=prefill_rate, max_running=len(trajs))
        for j, (ctx, k) in enumerate(trajs):
            inst.add(SimSequence(j, 0, prompt_len=ctx - 1, target_len=k + 1, generated=1))
        finished, _ = inst.advance(1e9)
        sim_decode = inst.busy_s - tokens / prefill_rate  # busy: the prefill, then the decode stretches
        if len(finished) != len(trajs):
            skipped += 1
            continue
        n, plen, _ = header.cells[i]
        rows.append({"cell": [n, plen, len(tail)], "measured_s": measured, "sim_s": sim_decode,
                     "rel_err": (sim_decode - measured) / measured})  # fmt: skip
    errs = [abs(r["rel_err"]) for r in rows]
    return {"cells": rows, "skipped": skipped, "mean_abs_rel_err": sum(errs) / max(1, len(errs)),
            "max_abs_rel_err": max(errs, default=0)}  # fmt: skip


def fit_samples(header: SamplesHeader, steps: list[Step], kv_capacity: int, name: str):
    import numpy as np

    from staleflow.coordinator.cost_model import CostModelError, fit_cost_model, fit_error

    dec = [(s.sample.n_running, float(s.sample.kv_tokens), s.sample.latency_s) for s in steps
           if s.sample.prefill_tokens == 0 and not s.warmup]  # fmt: skip
    if len(dec) < 4:
        raise CostModelError(f"only {len(dec)} pure-decode steps (after warm-up) in the samples: the fit needs >= 4")
    if len({n for n, _, _ in dec}) < 2:
        raise CostModelError("every decode step has the same batch size: the fit needs cells of >= 2 sizes")
    fit = fit_cost_model(dec, kv_capacity, name=name)
    mean_err, max_err = fit_error(fit, dec)
    y = np.array([d[2] for d in dec])
    pred = np.array([fit.step_time(n, kv) for n, kv, _ in dec])
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-30)
    pre = [s.sample for s in steps if s.sample.prefill_tokens > 0]
    prefill_rate = sum(s.prefill_tokens for s in pre) / max(sum(s.latency_s for s in pre), 1e-12) if pre else 0.0
    return fit, dec, {"mean_rel_err": mean_err, "max_rel_err": max_err, "r2": r2, "prefill_tokens_per_s": prefill_rate}


def prefill_mfu(target, rate: float) -> float | None:
    """The measured prefill rate as a fraction of the GPU's bf16 peak (2 x parameters FLOPs a token), where the
    preset's architecture and the profile's peak are known (sim/hardware: the simulator's default is 0.4)."""
    from staleflow.sim.hardware import MODEL_SPECS, PROFILES

    if not target or target[0] not in PROFILES or target[1] not in MODEL_SPECS or rate <= 0:
        return None
    spec = MODEL_SPECS[target[1]]
    return round(rate * 2.0 * spec.flop_params / (spec.tp * PROFILES[target[0]].bf16_tflops * 1e12), 4)


def profile_here(args) -> Path:
    """Without --samples: profile --model on this machine through record_cost_samples; returns the samples file."""
    import torch

    from staleflow.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cells = [(int(b), int(p), args.decode_steps) for b in args.batches.split(",") for p in args.prompt_lens.split(",")]
    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=torch.device(args.device))
    path = Path(args.save_samples or tempfile.mkstemp(prefix="cost_samples_", suffix=".jsonl")[1])
    record_cost_samples(model, path, cells, model_name=args.model, weights="checkpoint", chunk=args.prefill_chunk)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--batches", default="1,4,8,16,32,48")
    ap.add_argument("--prompt-lens", default="32,256")
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="engine prefill tokens per step")
    ap.add_argument("--kv-capacity", type=int, default=0, help="kv_capacity to store (default: the refitted "
                    "preset's, else the profiled engine's KV tokens)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--samples", default="", help="fit this cost-samples file instead of profiling")
    ap.add_argument("--save-samples", default="", help="write the profiled samples here (cost-samples format)")
    ap.add_argument("--out", default="", help="write the refitted cost model JSON here")
    ap.add_argument("--profile", default="", help="refit this simulator profile (h20, h100, h200, cpu): writes "
                    "presets/<preset>[-<profile>].json unless --out is given (sim/hardware.refit_name)")  # fmt: skip
    ap.add_argument("--preset", default="", help="the cost-model preset --profile refits (default: the model's)")
    args = ap.parse_args()
    from staleflow.coordinator.cost_model import CostModelError

    try:
        if not args.samples:
            import torch

            args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        path = Path(args.samples) if args.samples else profile_here(args)
        from staleflow.inputs import special_file

        if (problem := special_file(path)) is not None:  # a FIFO would hang the reader
            raise CostSamplesError(f"cost samples {str(path)!r} {problem}")
        try:
            header, steps = read_samples(path)
        except RecursionError:  # a line nested deeper than json can read
            raise CostSamplesError(f"cost samples {str(path)!r}: a line is nested too deeply to be read") from None
        target = resolve_target(header, args.profile, args.preset) if args.profile else None
        from staleflow.coordinator.cost_model import PRESET_DIR, load_cost_model

        kv_cap = args.kv_capacity or (load_cost_model(target[1]).kv_capacity if target else header.max_kv_tokens)
        name = target[2] if target else f"{header.device}-{Path(header.model).name}"
        fit, dec, quality = fit_samples(header, steps, kv_cap, name)
        out_path = Path(args.out) if args.out else (PRESET_DIR / f"{target[2]}.json" if target else None)
    except (CostSamplesError, CostModelError, ValueError, OSError) as e:
        print(f"fit_cost_model: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    hw = header.gpu or f"{header.cpu}, {header.threads} torch threads"
    out = {
        "name": name,
        **{k: getattr(fit, k) for k in ("k1", "k2", "k3", "b3", "k4", "kv_capacity")},
        "model": header.model,
        "dtype": header.dtype,
        "hardware": hw,
        "torch": header.torch,
        "date": header.date or time.strftime("%Y-%m-%d"),
        "load_average_1min": header.load_average_1min,
        "fit": {
            "samples": len(dec),
            "mean_rel_err": round(quality["mean_rel_err"], 4),
            "max_rel_err": round(quality["max_rel_err"], 4),
            "r2": round(quality["r2"], 4),
            "prefill_tokens_per_s": round(quality["prefill_tokens_per_s"], 1),
            "cells": [list(c) for c in header.cells],
            "profile": target[0] if target else None,
            "prefill_mfu": prefill_mfu(target, quality["prefill_tokens_per_s"]),
        },
        "source": f"{SOURCE} refit of {path.name} ({header.source or 'cost samples'}; engine {header.engine} "
        f"{header.decode_backend}{' + CUDA graphs' if header.cuda_graphs else ''}, {header.weights} weights at "
        f"{header.model}'s shape, {header.dtype}, TP{header.tp}, {header.date}): pure-decode steps, first of "
        f"each cell dropped, staleflow.coordinator.fit_cost_model (relative residuals, soft-L1)",
    }
    print(
        f"fit: k1={fit.k1:.3e} s/KV-token  k2={fit.k2:.3e} s  k3={fit.k3:.3e} s/seq  b3={fit.b3:.3e} s  over "
        f"{len(dec)} decode steps: mean rel err {quality['mean_rel_err']:.1%} (max {quality['max_rel_err']:.1%}), "
        f"R^2 {quality['r2']:.3f}; prefill {quality['prefill_tokens_per_s']:.0f} tok/s; on {hw}"
    )
    if out_path:  # written first, so the check below replays the file the simulator reads
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(out, indent=2) + "\n")
        except OSError as e:
            print(
                f"fit_cost_model: cannot write {out_path} ({e.strerror or e}): give a writable --out", file=sys.stderr
            )
            return 2
    sim_cost = load_cost_model(str(out_path)) if out_path else fit
    if quality["prefill_tokens_per_s"] > 0:
        check = check_with_simulator(sim_cost, header, steps, quality["prefill_tokens_per_s"])
        for r in check["cells"]:
            n, plen, k = r["cell"]
            print(f"  sim check n={n:4d} prompt={plen:5d} {k} decode steps: measured {r['measured_s']:.4f} s, "
                  f"simulated {r['sim_s']:.4f} s ({r['rel_err']:+.1%})")  # fmt: skip
        print(f"simulator vs measured decode time per cell: mean |err| {check['mean_abs_rel_err']:.1%}, "
              f"max {check['max_abs_rel_err']:.1%} over {len(check['cells'])} cells"
              + (f" ({check['skipped']} not replayable)" if check["skipped"] else ""))  # fmt: skip
        out["fit"]["sim_cell_mean_abs_rel_err"] = round(check["mean_abs_rel_err"], 4)
        out["fit"]["sim_cell_max_abs_rel_err"] = round(check["max_abs_rel_err"], 4)
    if out_path:
        out_path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {out_path}" + (f" (profile {target[0]}, preset {target[1]})" if target else ""))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
