"""Benchmark of the data and reward path: reward throughput (RewardPool vs inline) and, with
--model, the starting accuracy of a policy on a built-in task (is the task learnable?).

    python scripts/bench_data_reward.py                          # reward throughput only
    python scripts/bench_data_reward.py --model smollm2-135m --n 64
    python scripts/bench_data_reward.py --render --skip-reward     # chat-template rendering in its budget

Prints the hardware, the settings, the inline baseline measured in the same run and the ratio;
the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def reward_throughput(fn: str, n: int, workers: int) -> dict:
    from staleflow.config import RewardConfig
    from staleflow.reward import RewardPool, resolve_reward_fn, score

    if fn == "math":
        completions = [(f"Halving gives \\boxed{{\\frac{{{i}}}{{2}}}}", f"{i / 2}") for i in range(n)]
    else:
        completions = [(f"{i} + {i} = {2 * i}, so \\boxed{{{2 * i}}}.", str(2 * i)) for i in range(n)]
    f = resolve_reward_fn(fn)
    score(f, *completions[0], {})  # warm imports
    t0 = time.perf_counter()
    inline = [score(f, c, a, {})[0] for c, a in completions]
    t_inline = time.perf_counter() - t0
    pool = RewardPool(RewardConfig(fn=fn, workers=workers))
    pool.submit("warm", *completions[0], {})
    pool.drain(120)  # workers started and warm
    t0 = time.perf_counter()
    for i, (c, a) in enumerate(completions):
        pool.submit(i, c, a, {})
    got = {k: r for k, r, _ in pool.drain(300)}
    t_pool = time.perf_counter() - t0
    pool.close()
    assert [got[i] for i in range(n)] == inline, "pool and inline rewards differ"
    return {
        "fn": fn,
        "n": n,
        "workers": workers,
        "inline_per_s": n / t_inline,
        "pool_per_s": n / t_pool,
        "pool_vs_inline": t_inline / t_pool,
        "mean_reward": sum(inline) / n,
    }


def task_accuracy(model_path: str, task: str, n: int, max_new_tokens: int, temperature: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from staleflow.config import DataConfig
    from staleflow.data import PromptSource
    from staleflow.model import load_tokenizer, resolve_model_path
    from staleflow.reward import resolve_reward_fn, score

    folder = resolve_model_path(model_path)
    tok = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False).eval()
    prompts = PromptSource(DataConfig(source=task, seed=1234), tok).take(n)
    fn = resolve_reward_fn(task.removesuffix("-easy"))  # arithmetic-easy is scored by the arithmetic reward
    width = max(len(p.prompt_ids) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p.prompt_ids)) + p.prompt_ids for p in prompts])
    mask = torch.tensor([[0] * (width - len(p.prompt_ids)) + [1] * len(p.prompt_ids) for p in prompts])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            do_sample=temperature > 0,
            temperature=temperature or None,
            top_p=1.0,
            top_k=0,
        )
    gen_s = time.perf_counter() - t0
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    results = [score(fn, t, p.answer, p.meta) for t, p in zip(texts, prompts)]
    for p, t, (r, _) in list(zip(prompts, texts, results))[:4]:
        print(f"  [{r:.0f}] {p.text!r} -> {t[:120]!r}")
    return {
        "task": task,
        "n": n,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "accuracy": sum(r for r, _ in results) / n,
        "boxed_rate": sum(i["boxed"] for _, i in results) / n,
        "generate_s": gen_s,
    }


def render_overhead(n: int, repeats: int = 5) -> dict:
    """Per-prompt cost of rendering SmolLM2's chat template through env/template.render_chat (a trace
    on the template's code bounds steps, time and memory) against transformers' apply_chat_template
    alone, interleaved in the same run; medians over ``repeats`` rounds of ``n`` renders."""
    import statistics

    from staleflow.env.template import render_chat
    from staleflow.model.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12 + 30? Put it in \\boxed{}."},
    ]

    def per_call(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    plain, bounded = [], []
    for _ in range(repeats):
        plain.append(per_call(lambda: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)))
        bounded.append(per_call(lambda: render_chat(tok, msgs, add_generation_prompt=True)))
    a, b = statistics.median(plain), statistics.median(bounded)
    return {"apply_chat_template_us": round(a, 1), "render_chat_us": round(b, 1), "ratio": round(b / a, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="completions scored / prompts generated")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="", help="also measure a model's starting accuracy (e.g. smollm2-135m)")
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    ap.add_argument("--skip-reward", action="store_true", help="only measure the model's accuracy")
    ap.add_argument("--render", action="store_true", help="also measure the chat-template rendering budget's cost")
    args = ap.parse_args()
    print(
        f"host: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, load {os.getloadavg()[0]:.1f}"
    )
    result: dict = {"reward": {}}
    for fn in () if args.skip_reward else ("math", "arithmetic"):
        r = reward_throughput(fn, args.n, args.workers)
        result["reward"][fn] = r
        print(
            f"reward {fn:10s} n={args.n} inline {r['inline_per_s']:8.1f}/s   RewardPool({args.workers} workers) "
            f"{r['pool_per_s']:8.1f}/s   pool/inline {r['pool_vs_inline']:.2f}x"
        )
    if args.render:
        r = result["render"] = render_overhead(args.n)
        print(
            f"chat template (SmolLM2) n={args.n}: apply_chat_template {r['apply_chat_template_us']:.1f} us, "
            f"render_chat (budgeted) {r['render_chat_us']:.1f} us, ratio {r['ratio']:.2f}"
        )
    if args.model:
        result["accuracy"] = []
        for temperature in (float(t) for t in args.temperatures.split(",")):
            a = task_accuracy(args.model, args.task, args.n, args.max_new_tokens, temperature)
            result["accuracy"].append(a)
            print(
                f"{args.model} on {args.task} (temperature {temperature}): accuracy {a['accuracy']:.3f}, "
                f"boxed {a['boxed_rate']:.3f}, n={a['n']}, max_new_tokens={a['max_new_tokens']}, "
                f"generate {a['generate_s']:.1f}s"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
