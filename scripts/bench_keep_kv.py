"""Benchmark: what a weight pull costs a rollout instance, before and after issue 27 (item 1), on CPU.

    python scripts/bench_keep_kv.py                               # tiny-llama, 16 sequences
    python scripts/bench_keep_kv.py --model smollm2-135m --seqs 16 --prompt 128 --before 32 --after 16

Two measurements, each with its baseline in the same run:
1. in-flight sequences across a pull: ``--seqs`` sequences of ``--prompt`` prompt tokens decode
   ``--before`` tokens, the engine loads new weights, they decode ``--after`` more.
     re-prefill  load_weights(keep_kv=False): every sequence's K/V is recomputed under the new weights
     keep-kv     load_weights(keep_kv=True): the K/V stay, decoding continues at once
   Reports the tokens prefilled after the pull and the seconds from the load to the last token.
2. the pull's copies from a one-piece Parameter Server slot (shared memory):
     strided     into the engine's parameters as they were laid out before (views of transposed
                 fused [in, out] matrices: one strided copy per parameter)
     contiguous  into the engine's parameters now (row blocks of [out, in] fused matrices, the slot
                 laid out the same way: copies merged per fused matrix)
   Reports the copies per pull and the median seconds per pull (after one warm-up).
Prints a table and a last JSON line. Threads: torch.get_num_threads() (set OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid

import torch


def _engine(model_name: str, seqs: int, max_len: int):
    from staleflow.model import load_model
    from staleflow.rollout.builtin_engine import BuiltinEngine

    return BuiltinEngine(
        load_model(model_name, dtype=torch.float32, device="cpu"),
        max_running=seqs,
        max_kv_tokens=max(4096, seqs * max_len * 2),
        max_model_len=max_len,
        prefill_chunk_tokens=4096,
        profile=True,
    )


def across_a_pull(model_name: str, keep_kv: bool, seqs: int, prompt: int, before: int, after: int) -> dict:
    from staleflow.rollout import Request, SamplingParams

    eng = _engine(model_name, seqs, prompt + before + after + 8)
    vocab = eng.vocab_size
    new = {n: p.detach().clone() + 0.01 * torch.randn_like(p) for n, p in eng.model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for i in range(seqs):
        ids = torch.randint(2, vocab, (prompt,), generator=g).tolist()
        eng.add(Request(i, ids, SamplingParams(max_new_tokens=before + after, ignore_eos=True, seed=i)))
    while min((s.num_output for s in eng.seqs.values()), default=before) < before:
        eng.step()
    eng.profile_samples.clear()
    t0 = time.perf_counter()
    eng.load_weights(new, version=1, keep_kv=keep_kv)
    while eng.has_unfinished():
        eng.step()
    seconds = time.perf_counter() - t0
    return {
        "mode": "keep-kv" if keep_kv else "re-prefill",
        "prefill_tokens_after_pull": sum(s.prefill_tokens for s in eng.profile_samples),
        "seconds_after_pull": seconds,
    }


def _strided_targets(engine) -> dict[str, torch.Tensor]:
    """The engine's parameters as laid out before: views of transposed fused [in, out] matrices."""
    out = {}
    params = dict(engine.model.named_parameters())
    for layer in range(engine.model.args.num_layers):
        for prefix, names in (
            (f"model.layers.{layer}.self_attn", ("q_proj", "k_proj", "v_proj")),
            (f"model.layers.{layer}.self_attn", ("o_proj",)),
            (f"model.layers.{layer}.mlp", ("gate_proj", "up_proj")),
            (f"model.layers.{layer}.mlp", ("down_proj",)),
        ):
            ws = [params[f"{prefix}.{n}.weight"] for n in names]
            w_t = torch.cat([w.detach() for w in ws], 0).t().contiguous()
            off = 0
            for n, w in zip(names, ws):
                out[f"{prefix}.{n}.weight"] = w_t[:, off : off + w.shape[0]].t()
                off += w.shape[0]
    for n, p in params.items():
        out.setdefault(n, torch.empty_like(p))
    return out


def pull_copies(model_name: str, reps: int) -> list[dict]:
    from staleflow.servers import ParameterServer, ParamLayout

    engine = _engine(model_name, 2, 64)
    named = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    run = "kv" + uuid.uuid4().hex[:10]
    ps = ParameterServer.create(run, ParamLayout.from_named_tensors(named))
    try:
        ps.begin_push(1)
        for n, t in named.items():
            ps.write_shard(n, t)
        ps.publish(1)
        rows = []
        for mode, targets in (("strided", _strided_targets(engine)), ("contiguous", engine.weight_targets())):
            ps.pull(1, out=targets)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                ps.pull(1, out=targets)
                times.append(time.perf_counter() - t0)
            rows.append(
                {
                    "mode": mode,
                    "copies": ps.last_copies,
                    "params": len(targets),
                    "strided_targets": sum(not t.is_contiguous() for t in targets.values()),
                    "seconds": statistics.median(times),
                    "mb": ps.layout.nbytes / 2**20,
                }
            )
        return rows
    finally:
        ps.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--before", type=int, default=16)
    ap.add_argument("--after", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, model {a.model}"
    )
    pulls = [across_a_pull(a.model, keep, a.seqs, a.prompt, a.before, a.after) for keep in (False, True)]
    print(f"\n{a.seqs} sequences, prompt {a.prompt}, {a.before} tokens before the pull, {a.after} after")
    print(f"{'mode':<12} {'prefill tokens after pull':>26} {'s after pull':>13}")
    for r in pulls:
        print(f"{r['mode']:<12} {r['prefill_tokens_after_pull']:>26} {r['seconds_after_pull']:>13.3f}")
    speed = pulls[0]["seconds_after_pull"] / max(pulls[1]["seconds_after_pull"], 1e-9)
    print(f"ratio re-prefill / keep-kv time after the pull: {speed:.2f}x")
    copies = pull_copies(a.model, a.reps)
    print(f"\npull from a one-piece slot ({copies[0]['mb']:.1f} MB), median of {a.reps}")
    print(f"{'mode':<12} {'copies':>7} {'params':>7} {'strided dst':>12} {'s per pull':>11}")
    for r in copies:
        print(f"{r['mode']:<12} {r['copies']:>7} {r['params']:>7} {r['strided_targets']:>12} {r['seconds']:>11.4f}")
    print(f"ratio strided / contiguous: {copies[0]['seconds'] / max(copies[1]['seconds'], 1e-9):.2f}x")
    print(json.dumps({"pulls": pulls, "copies": copies, "model": a.model, "seqs": a.seqs, "prompt": a.prompt}))


if __name__ == "__main__":
    main()
