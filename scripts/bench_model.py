"""Benchmark: our packed CausalLM forward (and forward+backward) vs transformers on a padded batch.

    python scripts/bench_model.py                                   # smollm2-135m, CPU
    python scripts/bench_model.py --model tiny-qwen3 --lengths 64,256,512,1024
    python scripts/bench_model.py --device cuda --dtype bfloat16 --lengths 512,2048,4096,8192

Both sides get the same sequences (random token ids, lengths from --lengths) and weights.
Baseline: transformers AutoModelForCausalLM (attn_implementation="sdpa") on a right-padded
[B, max_len] batch with an attention mask: the usual way to batch unequal lengths without a
varlen kernel. Ours: one packed [sum(lengths)] stream with PackedAttention (no padding).
Work per step: logits for every real token, then logsumexp summed (backward from that).
Prints hardware, shapes, median seconds over --reps, tokens/s, the ratio, and a last JSON line.
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch


def timed(fn, reps: int, sync) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="16,48,96,128")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from staleflow.model import PackedAttention, load_model, resolve_model_path
    from staleflow.model.attention import cu_seqlens_from_lengths, packed_positions

    dtype = getattr(torch, a.dtype)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    lengths = [int(x) for x in a.lengths.split(",")]
    ours = load_model(a.model, dtype=dtype, device=dev)
    ref = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(a.model), dtype=dtype, attn_implementation="sdpa", trust_remote_code=False
    ).to(dev)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, ours.args.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs).to(dev)
    cu = cu_seqlens_from_lengths(lengths).to(dev)
    pos = packed_positions(cu)
    B, L = len(lengths), max(lengths)
    padded = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)], mask[i, : len(s)] = s, 1
    padded, mask = padded.to(dev), mask.to(dev)
    valid = mask.bool()

    def ours_step(backward: bool):
        with torch.set_grad_enabled(backward):
            h = ours(ids, pos, PackedAttention(cu))
            loss = ours.compute_logits(h).logsumexp(-1).sum()
            if backward:
                loss.backward()

    def ref_step(backward: bool):
        with torch.set_grad_enabled(backward):
            logits = ref(input_ids=padded, attention_mask=mask).logits
            loss = logits[valid].float().logsumexp(-1).sum()
            if backward:
                loss.backward()

    cpu = platform.processor() or platform.machine()
    if dev.type == "cuda":
        cpu = torch.cuda.get_device_name(dev)
    print(
        f"hardware: {cpu}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"model: {a.model} ({ours.num_params() / 1e6:.1f}M params), dtype {a.dtype}, lengths {lengths} "
        f"(packed {sum(lengths)} tokens, padded {B}x{L} = {B * L})"
    )
    print(f"{'step':<18}{'ours s':>10}{'hf padded s':>13}{'ours tok/s':>12}{'speedup':>9}")
    result = {"model": a.model, "device": a.device, "dtype": a.dtype, "lengths": lengths}
    for name, backward in (("forward", False), ("forward+backward", True)):
        t_ours = timed(lambda: ours_step(backward), a.reps, sync)
        t_ref = timed(lambda: ref_step(backward), a.reps, sync)
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        print(f"{name:<18}{t_ours:>10.3f}{t_ref:>13.3f}{sum(lengths) / t_ours:>12.0f}{t_ref / t_ours:>8.2f}x")
        result[name] = {"ours_s": t_ours, "hf_padded_s": t_ref, "speedup": t_ref / t_ours}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
