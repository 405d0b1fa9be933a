"""Answer evaluation prompts with a rollout engine and score them.

    answers = generate(engine, prompts, samples=1, params=SamplingParams(temperature=0.0, max_new_tokens=256))
    result = score_answers(answers, prompts, reward_fn, tokenizer)   # accuracy, interval, pass@K, per-prompt rows

The engine is any RolloutEngine (rollout/engine.py): only add / step / has_unfinished are used, so
the built-in engine, the vLLM engine or a scripted stand-in (tests) all work. A prompt answered K
times is K requests with consecutive seeds; identical prompts share their prefill in the built-in
engine (prefix sharing), as a GRPO group does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from staleflow.eval.scoring import is_correct, summarize
from staleflow.rollout.engine import Request, RolloutEngine, SamplingParams


def generate(
    engine: RolloutEngine,
    prompts: Sequence,
    samples: int,
    params: SamplingParams,
    on_finished: Callable[[int], None] | None = None,
) -> list[list[list[int]]]:
    """Token ids of `samples` answers to each prompt (prompt i, sample j -> [i][j]).

    Greedy (params.greedy) asks once per prompt whatever `samples` is; sampled answers use seeds
    params.seed + i * samples + j (reproducible, distinct). on_finished(count) after each answer."""
    k = 1 if params.greedy else samples
    base = params.seed or 0
    out: list[list[list[int] | None]] = [[None] * k for _ in prompts]
    for i, p in enumerate(prompts):
        for j in range(k):
            sp = params if params.greedy else dataclasses.replace(params, seed=base + i * k + j)
            engine.add(Request(i * k + j, list(p.prompt_ids), sp))
    done = 0
    while engine.has_unfinished():
        for res in engine.step():
            i, j = divmod(int(res.request_id), k)
            out[i][j] = list(res.tokens.response_ids)
            done += 1
            if on_finished is not None:
                on_finished(done)
    missing = sum(a is None for row in out for a in row)
    if missing:
        raise RuntimeError(f"the engine stopped with {missing} of {len(prompts) * k} answers missing")
    return out  # type: ignore[return-value]


def score_answers(answers: list[list[list[int]]], prompts: Sequence, reward_fn, tokenizer) -> tuple[dict, list[dict]]:
    """(summary, per-prompt rows). summary: eval/scoring.summarize plus reward_errors (calls that
    raised: scored wrong) and the first error; rows: prompt text, answer, correct per sample, first
    completion."""
    correct, rows, errors, first_error = [], [], 0, ""
    for p, outs in zip(prompts, answers):
        texts = tokenizer.batch_decode(outs, skip_special_tokens=True)
        marks = []
        for text in texts:
            ok, info = is_correct(reward_fn, text, p.answer, p.meta)
            marks.append(ok)
            if info["error"]:
                errors += 1
                first_error = first_error or info["error"]
        correct.append(marks)
        rows.append({"prompt": p.text, "answer": p.answer, "correct": marks, "completion": texts[0]})
    summary = summarize(correct)
    summary["reward_errors"] = errors
    if first_error:
        summary["reward_first_error"] = first_error
    return summary, rows
