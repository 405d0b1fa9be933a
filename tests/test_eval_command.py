"""`staleflow eval` and the intervals behind every accuracy the project prints (metrics/stats.py).

Known accuracies: a scripted stand-in engine answers a chosen subset of prompts right (greedy and
sampled), and the real command on a real (tiny) model with a reward that reads only the data row
(`row_flag`), so the accuracy is fixed by the file, whatever the model writes.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.metrics.stats import bootstrap_mean, pass_at_k, spearman, t_interval, wilson

ROOT_DIR = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def row_flag(completion: str, answer: str, meta: dict) -> float:
    """Full credit when the row's answer is "right", whatever the completion (a known accuracy)."""
    return 1.0 if answer == "right" else 0.0


# ---- intervals ---------------------------------------------------------------------------------


def test_ci95_wilson_bounds_solve_the_score_equation():
    z = 1.959963984540054
    for k, n in ((0, 10), (3, 10), (81, 263), (64, 128), (127, 128), (128, 128)):
        lo, hi = wilson(k, n)
        p = k / n
        assert 0.0 <= lo <= p <= hi <= 1.0
        for bound in (lo, hi):  # Wilson's bounds are the p0 with |p - p0| = z sqrt(p0 (1 - p0) / n)
            if bound not in (0.0, 1.0) or 0 < k < n:
                assert (p - bound) ** 2 == pytest.approx(z * z * bound * (1 - bound) / n, rel=1e-9, abs=1e-12)
    assert wilson(0, 10) == (0.0, pytest.approx(z * z / (10 + z * z)))
    assert wilson(81, 263) == (pytest.approx(0.2553, abs=1e-4), pytest.approx(0.3662, abs=1e-4))  # Newcombe 1998
    with pytest.raises(ValueError):
        wilson(3, 0)


def test_ci95_wilson_covers_the_true_accuracy_95_percent_of_the_time():
    rng, n, trials = random.Random(7), 128, 4000
    for p in (0.1, 0.4, 0.6):
        hits = 0
        for _ in range(trials):
            lo, hi = wilson(sum(rng.random() < p for _ in range(n)), n)
            hits += lo <= p <= hi
        assert 0.93 <= hits / trials <= 0.97, (p, hits / trials)


def test_ci95_bootstrap_is_seeded_and_brackets_the_mean():
    rng = random.Random(3)
    vals = [rng.random() for _ in range(200)]
    lo, hi = bootstrap_mean(vals)
    assert lo < sum(vals) / len(vals) < hi and bootstrap_mean(vals) == (lo, hi)
    sd = math.sqrt(sum((v - 0.5) ** 2 for v in vals) / len(vals))
    assert (hi - lo) == pytest.approx(2 * 1.96 * sd / math.sqrt(len(vals)), rel=0.15)  # ~ the normal width
    assert bootstrap_mean([1.0, 1.0, 1.0]) == (1.0, 1.0)


def test_ci95_t_interval_and_pass_at_k():
    lo, hi = t_interval([1.0, 2.0, 3.0])
    assert (lo, hi) == (pytest.approx(2 - 4.302653 / math.sqrt(3)), pytest.approx(2 + 4.302653 / math.sqrt(3)))
    assert t_interval([0.5]) is None
    for n, c, k in ((5, 0, 1), (5, 1, 1), (5, 2, 3), (8, 3, 8), (6, 6, 2)):
        subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_spearman_known_values_and_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # no ties: 1 - 6 sum d^2 / (n (n^2 - 1)); ranks (1,2,3,4,5) vs (2,1,4,3,5): sum d^2 = 4
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(1 - 6 * 4 / (5 * 24))
    # ties take their average rank: y ranks (1.5, 1.5, 3.5, 3.5) against x ranks (1, 2, 3, 4)
    assert spearman([0, 1, 2, 3], [7, 7, 9, 9]) == pytest.approx(4 / math.sqrt(5 * 4))
    assert math.isnan(spearman([1], [1])) and math.isnan(spearman([1, 2, 3], [5, 5, 5]))
    assert math.isnan(spearman([1, float("nan"), 3], [1, 2, 3]))
    with pytest.raises(ValueError, match="3 values against 2"):
        spearman([1, 2, 3], [1, 2])


# ---- the evaluation with a scripted engine (known accuracy) -------------------------------------


class ScriptedEngine:
    """A stand-in RolloutEngine: answers each request with the text script(prompt_ids, seed)."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.queue = tokenizer, script, []

    def add(self, request):
        self.queue.append(request)

    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        from staleflow.rollout.engine import Request
        from staleflow.trajectory import TrajectoryTokens

        r = self.queue.pop(0)
        prompt = r.tokens.prompt_ids
        ids = self.tok.encode(self.script(tuple(prompt), r.params.seed), add_special_tokens=False)
        tokens = TrajectoryTokens(prompt, ids, [0.0] * len(ids), [0] * len(ids))
        return [Request(r.request_id, tokens, r.params, seed=0, finish_reason="stop")]


@pytest.fixture(scope="module")
def tok():
    from staleflow.model import load_tokenizer
    from staleflow.model.aliases import ensure_tokenizer

    return load_tokenizer(str(ensure_tokenizer()))


def _held_out(tok, n):
    from staleflow.config import DataConfig
    from staleflow.data import PromptSource

    return PromptSource(DataConfig(source="arithmetic-easy"), tok).hold_out(n)


def test_eval_command_scripted_engine_greedy_has_the_known_accuracy(tok):
    from staleflow.eval.runner import generate, score_answers
    from staleflow.reward.functions import resolve_reward_fn
    from staleflow.rollout.engine import SamplingParams

    prompts = _held_out(tok, 40)
    right = {tuple(p.prompt_ids): p.answer for p in prompts[::3]}  # 14 of 40 answered right
    engine = ScriptedEngine(tok, lambda ids, seed: f"It is \\boxed{{{right.get(ids, '-1')}}}.")
    answers = generate(engine, prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=16))
    summary, rows = score_answers(answers, prompts, resolve_reward_fn("arithmetic"), tok)
    assert summary["n"] == 40 and summary["accuracy"] == pytest.approx(14 / 40)
    assert (summary["ci95_low"], summary["ci95_high"]) == wilson(14, 40) and summary["ci_method"] == "wilson"
    assert [r["correct"] for r in rows] == [[i % 3 == 0] for i in range(40)] and "pass_at_k" not in summary


def test_eval_command_scripted_engine_sampled_gives_mean_accuracy_and_pass_at_k(tok):
    from staleflow.eval.runner import generate, score_answers
    from staleflow.reward.functions import resolve_reward_fn
    from staleflow.rollout.engine import SamplingParams

    prompts, k = _held_out(tok, 12), 4
    gold = {tuple(p.prompt_ids): (i, p.answer) for i, p in enumerate(prompts)}

    def script(ids, seed):  # prompt i: its first i % 5 samples are right (seed = 100 + i * k + j)
        i, answer = gold[ids]
        j = seed - 100 - i * k
        return f"\\boxed{{{answer}}}" if j < i % 5 else "\\boxed{-1}"

    answers = generate(
        ScriptedEngine(tok, script), prompts, k, SamplingParams(temperature=1.0, max_new_tokens=8, seed=100)
    )
    summary, _ = score_answers(answers, prompts, resolve_reward_fn("arithmetic"), tok)
    right = [min(i % 5, k) for i in range(12)]
    assert summary["accuracy"] == pytest.approx(sum(right) / (12 * k))
    assert summary["pass_at_k"] == pytest.approx(sum(r > 0 for r in right) / 12)
    assert summary["samples"] == k and summary["ci_method"].startswith("bootstrap")
    assert summary["ci95_low"] < summary["accuracy"] < summary["ci95_high"]


# ---- the command itself (real engine, tiny model) ------------------------------------------------


def _eval(*args, cwd=None):
    # the checkout named on purpose, as docs/extending.md's PYTHONPATH=$PWD (no process puts the working
    # directory on its import path): examples.* import from there
    path = [str(TESTS), *([str(cwd)] if cwd is not None else []), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run(
        [sys.executable, "-m", "staleflow", "eval", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=cwd,
    )


def _rows(path: Path, flags: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": f}) + "\n" for i, f in enumerate(flags)))
    return path


@pytest.mark.slow
def test_eval_command_real_engine_known_accuracy_and_run_folder(tmp_path):
    from staleflow.model.aliases import ensure_alias

    data = _rows(tmp_path / "d.jsonl", ["right", "wrong", "right", "wrong", "wrong"] * 4)  # 8 of 20
    run = tmp_path / "run"
    shutil.copytree(ensure_alias("tiny-llama"), run / "hf")  # a run folder: its policy is run/hf
    res = _eval(
        "--model.path",
        str(run),
        "--data.source",
        str(data),
        "--reward.fn",
        "test_eval_command:row_flag",
        "--rollout.max-new-tokens",
        "4",
        "--samples",
        "2",
        "--out",
        str(tmp_path / "rows.jsonl"),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["n"] == 20 and out["accuracy"] == pytest.approx(0.4) and out["pass_at_k"] == pytest.approx(0.4)
    assert out["model_folder"] == str(run / "hf") and out["data"] == str(data) and out["mode"] == "sampled"
    assert out["ci95_low"] < 0.4 < out["ci95_high"] and 1 <= out["response_len_mean"] <= 4
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 20

    res = _eval(
        "--model.path",
        "tiny-llama",
        "--data.source",
        str(data),
        "--reward.fn",
        "test_eval_command:row_flag",
        "--rollout.max-new-tokens",
        "4",
        "--n",
        "5",
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0 and out["n"] == 5 and out["accuracy"] == pytest.approx(0.4)
    assert (out["ci95_low"], out["ci95_high"]) == pytest.approx(wilson(2, 5)) and out["ci_method"] == "wilson"


@pytest.mark.slow
def test_eval_command_bad_inputs_are_one_line_and_exit_2(tmp_path):
    from staleflow.model.aliases import ensure_alias

    good = _rows(tmp_path / "good.jsonl", ["3", "4"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Say 1.", "answer": "7"}) + "\n{not json\n")
    broken = tmp_path / "broken"
    shutil.copytree(ensure_alias("tiny-llama"), broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    unfinished = tmp_path / "unfinished-run"
    unfinished.mkdir()
    (unfinished / "metrics.jsonl").write_text("")
    cases = {
        "does not exist": ["--model.path", str(tmp_path / "nope"), "--data.source", str(good)],
        "bad.jsonl:2": ["--model.path", "tiny-llama", "--data.source", str(bad)],
        "is not a readable safetensors file": ["--model.path", str(broken), "--data.source", str(good)],
        "without an exported policy": ["--model.path", str(unfinished), "--data.source", str(good)],
        "give --n": ["--model.path", "tiny-llama", "--data.source", "arithmetic-easy"],
        "no such file": ["--model.path", "tiny-llama", "--data.source", str(tmp_path / "missing.jsonl")],
        "not a registered reward": ["--model.path", "tiny-llama", "--data.source", str(good), "--reward.fn", "nope"],
        "--rollout.engine='nope'": [
            "--model.path",
            "tiny-llama",
            "--data.source",
            str(good),
            "--rollout.engine",
            "nope",
        ],
    }
    import torch

    if not torch.cuda.is_available():
        cases["no CUDA device"] = ["--model.path", "tiny-llama", "--data.source", str(good), "--device", "cuda"]
    for needle, args in cases.items():
        res = _eval(*args)
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert res.returncode == 2 and res.stdout == "", (needle, res.returncode, res.stderr[-1500:])
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.stderr, (needle, res.stderr[-1500:])


@pytest.mark.slow
def test_eval_command_runs_the_engine_backend_it_is_given(tmp_path):
    """--rollout.engine reaches eval as it reaches train: the worked fork (examples/lockstep_engine.py,
    the built-in engine stepped in lockstep batches) answers the same greedy prompts the same way."""
    data = _rows(tmp_path / "d.jsonl", ["right", "wrong", "right", "wrong", "wrong"] * 2)
    args = ["--model.path", "tiny-llama", "--data.source", str(data), "--reward.fn", "test_eval_command:row_flag"]
    args += ["--rollout.max-new-tokens", "4"]
    outs = {}
    for engine in ("builtin", "examples.lockstep_engine:LockstepBackend"):
        res = _eval(*args, "--rollout.engine", engine, "--out", str(tmp_path / f"{len(outs)}.jsonl"), cwd=ROOT_DIR)
        assert res.returncode == 0, res.stderr[-2000:]
        outs[engine] = json.loads(res.stdout.strip().splitlines()[-1])
        assert outs[engine]["engine"] == engine and outs[engine]["device"] == "cpu"
    assert outs["builtin"]["accuracy"] == outs["examples.lockstep_engine:LockstepBackend"]["accuracy"] == 0.4
    assert (tmp_path / "0.jsonl").read_text() == (tmp_path / "1.jsonl").read_text()  # the same answers
