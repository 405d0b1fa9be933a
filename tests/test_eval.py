"""Held-out evaluation: the held-out split is never trained on, answers are scored with the run's
reward, and a run logs evaluation rows at step 0, every K steps and at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from staleflow.config import DataConfig
from staleflow.control.messages import Evaluated, eval_request_id, is_eval, split_eval_id
from staleflow.data import PromptSource
from staleflow.model import load_tokenizer
from staleflow.model.aliases import ensure_tokenizer
from staleflow.runtime.evaluation import HeldOutEval
from staleflow.servers import TrajectoryRing
from staleflow.trajectory import TrajectoryTokens


class RingRecords:
    """A rollout rank's ring as the controller's backend sees it (read, free), and the producer that
    writes held-out answers into it as the rank does."""

    def __init__(self):
        self.ring = TrajectoryRing.create("e" + uuid.uuid4().hex[:10], 1, 1 << 16)
        self.read, self.freed = self.ring.read, []

    def free(self, handles):
        self.freed += handles
        for h in handles:
            self.ring.free(h)

    def answer(self, eval_id: int, index: int, ids: list[int], lo: int, hi: int) -> Evaluated:
        t = TrajectoryTokens([1], list(ids), [-0.5] * len(ids), [hi] * len(ids))
        return Evaluated(eval_id, index, self.ring.write(t), lo, hi)

    def close(self):
        self.ring.close()
        self.ring.unlink()


@pytest.fixture
def records():
    r = RingRecords()
    yield r
    r.close()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ensure_tokenizer()))


def test_eval_held_out_task_prompts_are_never_drawn_for_training(tok):
    src = PromptSource(DataConfig(source="arithmetic", seed=3), tok)
    held = src.hold_out(64)
    texts = {p.text for p in held}
    assert len(texts) == 64 and all(p.meta["held_out"] for p in held)
    train = [next(src).text for _ in range(3000)]
    assert not texts & set(train)
    again = PromptSource(DataConfig(source="arithmetic", seed=3), tok)
    assert [p.text for p in again.hold_out(64)] == [p.text for p in held]  # the same split every time
    with pytest.raises(Exception, match="before any training prompt"):
        src.hold_out(4)


def test_eval_held_out_file_rows_leave_the_training_set(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(40))
    )
    src = PromptSource(DataConfig(source=str(path)), tok)
    held = src.hold_out(10)
    train = {next(src).text for _ in range(30)}
    assert len(train) == 30 and not {p.text for p in held} & train
    with pytest.raises(Exception, match="too few to hold out"):
        PromptSource(DataConfig(source=str(path)), tok).hold_out(25)


def test_eval_answers_are_scored_with_the_reward_and_logged_once_complete(tok, records):
    src = PromptSource(DataConfig(source="arithmetic"), tok)
    prompts = src.hold_out(3)
    ev = HeldOutEval(prompts, "arithmetic", tok, max_new_tokens=32)
    sent = []
    eval_id = ev.start(5, [1, 2], lambda rank, msg: sent.append((rank, msg)))
    assert sorted(i for _, m in sent for i in m.indices) == [0, 1, 2]
    answers = [f"The answer is \\boxed{{{prompts[0].answer}}}", prompts[1].answer, "\\boxed{-999}"]
    rows = [ev.on_answer(records.answer(eval_id, i, tok.encode(a), 4, 5), records) for i, a in enumerate(answers)]
    assert len(records.freed) == 3 and records.ring.live_records == 0  # read back from the ring, then freed
    assert rows[:2] == [None, None]
    row = rows[2]
    assert row["step"] == 5 and row["eval_n"] == 3 and row["eval_accuracy"] == pytest.approx(2 / 3)
    assert row["eval_boxed_rate"] == pytest.approx(2 / 3) and row["eval_versions"] == [4, 5]
    assert row["eval_correct"] == "110"  # per prompt, held-out order (bench_convergence's evaluation noise)


def test_ci95_in_held_out_rows_console_lines_and_report_plot(tok, tmp_path, records):
    """The main job's evaluation row carries its Wilson interval; the console line and the report
    plot show it."""
    from staleflow.metrics.report import _held_out, make_report
    from staleflow.metrics.stats import wilson
    from staleflow.metrics.writer import MetricsWriter
    from staleflow.runtime.evaluation import eval_line, gain_line

    prompts = PromptSource(DataConfig(source="arithmetic-easy"), tok).hold_out(10)
    ev = HeldOutEval(prompts, "arithmetic", tok, max_new_tokens=16)
    eval_id = ev.start(0, [1], lambda rank, msg: None)
    for i, p in enumerate(prompts):  # 7 of 10 right
        row = ev.on_answer(records.answer(eval_id, i, tok.encode(p.answer if i < 7 else "-5"), 0, 0), records)
    assert row["eval_accuracy"] == pytest.approx(0.7)
    assert (row["eval_ci95_low"], row["eval_ci95_high"]) == wilson(7, 10)
    assert f"0.700 (95% CI {row['eval_ci95_low']:.3f}-{row['eval_ci95_high']:.3f})" in eval_line(0, row)
    first = {**row, "eval_accuracy": 0.4, "step": 0}
    assert "gain +0.300" in gain_line(first, {**row, "step": 20})

    w = MetricsWriter(str(tmp_path), tensorboard=False)
    w.log_step(0, {"reward_mean": 0.1})
    for step, k in ((0, 4), (10, 7)):
        lo, hi = wilson(k, 10)
        w.log_eval(step, {"eval_accuracy": k / 10, "eval_ci95_low": lo, "eval_ci95_high": hi, "eval_n": 10})
    w.close()
    assert os.path.isfile(make_report(str(tmp_path)))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    _held_out(ax, [{"step": 0, "eval_accuracy": 0.4, "eval_ci95_low": 0.2, "eval_ci95_high": 0.65, "eval_n": 10}])
    (bars,) = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    segment = bars.lines[2][0].get_segments()[0]  # the vertical bar spans exactly the interval
    assert [round(y, 6) for _, y in segment] == [0.2, 0.65]
    plt.close(fig)


def test_eval_request_ids_are_negative_and_round_trip():
    for e, i in ((0, 0), (3, 17), (9, (1 << 20) - 1)):
        rid = eval_request_id(e, i)
        assert is_eval(rid) and split_eval_id(rid) == (e, i)
    assert not is_eval(0) and not is_eval(12)


@pytest.mark.slow
def test_eval_rows_in_a_run_at_start_every_k_and_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
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
        "--steps",
        "4",
        "--eval.n",
        "6",
        "--eval.every",
        "2",
        "--log.run-dir",
        str(tmp_path),
        "--log.name",
        "run",
        "--log.no-progress",
        "--reward.fn",
        "e2e_rewards:text_length",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_n" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and all(r["eval_n"] == 6 for r in evals)
    assert evals[-1]["eval_versions"] == [4, 4]  # the final evaluation runs on the final weights
    assert [r["step"] for r in rows if "eval_n" not in r] == [0, 1, 2, 3]
    assert "held-out accuracy" in res.stdout


def test_eval_easy_arithmetic_answers_are_right_and_in_range():
    import re

    from staleflow.data.tasks import TASKS

    for k in range(300):
        text, answer, meta = TASKS["arithmetic-easy"](0, k)
        a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)\?", text).groups()
        a, b = int(a), int(b)
        assert int(answer) == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0 and meta["task"] == "arithmetic-easy"
        assert (a <= 30 and b <= 30) if op == "+" else (a <= 50) if op == "-" else (a <= 9 and b <= 9)
    assert TASKS["arithmetic-easy"](0, 5) == TASKS["arithmetic-easy"](0, 5) != TASKS["arithmetic"](0, 5)
