"""Held-out evaluation on the rollout ranks: greedy answers decoded alongside the rollout.

Controller side (``HeldOutEval``, used by runtime/job.py): the held-out prompts are split
across the instances (``Evaluate``); answers come back one by one through the rings like
training's trajectories (``Evaluated`` names the rank's record: it is read, then freed with
FreeRecords as a consumed trajectory is), are decoded (the model's last turn: with --env.name the
held-out prompts talk to the environment like training's, and ``eval_turns_mean`` is reported)
and scored with the run's reward function in the controller (correct = answer reward >= 1, as in
``staleflow eval``: eval/scoring.py), and an evaluation row goes to metrics.jsonl once all of them
are in, with its 95% Wilson interval (``eval_ci95_low``, ``eval_ci95_high``); with --data.mix
also each source's accuracy and count (``eval_accuracy@SOURCE``, ``eval_n@SOURCE``). Rank side: evaluation requests live in the same engine under negative ids (``is_eval``,
``eval_request_id`` in control/messages.py, beside the messages), so the coordinator never sees
them (they are left out of snapshots and never interrupted by a pull).
"""

from __future__ import annotations

import time

from staleflow.control.messages import Evaluate, Evaluated
from staleflow.workers.turns import final_turn_ids, model_turns


class HeldOutEval:
    """One held-out set; evaluations are started by step and finished when every answer is in."""

    def __init__(self, prompts, reward_fn, tokenizer, max_new_tokens: int, with_env: bool = False):
        from staleflow.reward.functions import resolve_reward_fn

        self.prompts, self.tokenizer, self.max_new_tokens = prompts, tokenizer, max_new_tokens
        self.with_env = with_env
        """An environment resets from each prompt's row: its answer and meta travel with the prompts."""
        self.fn = resolve_reward_fn(reward_fn)
        self.running: dict[int, dict] = {}  # eval_id -> {"step", "answers", "t0", ...}
        self.results: list[dict] = []
        self._next = 0

    def start(self, step: int, ranks: list[int], send) -> int:
        """Send the held-out prompts round-robin to the rollout ranks; returns the eval id."""
        eval_id, self._next = self._next, self._next + 1
        self.running[eval_id] = {"step": step, "answers": {}, "t0": time.monotonic(), "versions": []}
        for j, rank in enumerate(ranks):
            idx = list(range(j, len(self.prompts), len(ranks)))
            if idx:
                send(
                    rank,
                    Evaluate(
                        eval_id=eval_id,
                        indices=idx,
                        prompts=[list(self.prompts[i].prompt_ids) for i in idx],
                        max_new_tokens=self.max_new_tokens,
                        answers=[self.prompts[i].answer for i in idx] if self.with_env else [],
                        metas=[dict(self.prompts[i].meta) for i in idx] if self.with_env else [],
                    ),
                )
        return eval_id

    def on_answer(self, msg: Evaluated, records) -> dict | None:
        """Record one answer; returns the finished evaluation row once all answers are in.

        ``records`` reads and frees ring records (runtime/backend.py's RuntimeBackend: ``read(handle)``
        -> TrajectoryTokens, ``free(handles)``); the answer's record is freed once read."""
        from staleflow.eval.scoring import is_correct, summarize

        try:
            tokens = records.read(msg.handle)
        finally:
            records.free([msg.handle])
        run = self.running.get(msg.eval_id)
        if run is None:
            return None
        p = self.prompts[msg.index]
        # the model's last turn, as a training trajectory's reward reads it (all of a single-turn response)
        text = self.tokenizer.decode(final_turn_ids(tokens), skip_special_tokens=True)
        ok, info = is_correct(self.fn, text, p.answer, p.meta)
        run["answers"][msg.index] = (ok, len(tokens.response_ids), info["boxed"], text, len(model_turns(tokens)))
        run["versions"] += [msg.min_version, msg.max_version]
        if len(run["answers"]) < len(self.prompts):
            return None
        del self.running[msg.eval_id]
        answers = [run["answers"][i] for i in range(len(self.prompts))]
        summary = summarize([[a[0]] for a in answers])
        row = {
            "eval_accuracy": summary["accuracy"],
            "eval_ci95_low": summary["ci95_low"],
            "eval_ci95_high": summary["ci95_high"],
            "eval_n": len(answers),
            "eval_response_len_mean": sum(a[1] for a in answers) / len(answers),
            "eval_boxed_rate": sum(a[2] for a in answers) / len(answers),
            "eval_versions": [min(run["versions"]), max(run["versions"])],
            "eval_s": time.monotonic() - run["t0"],
            "eval_sample": answers[0][3][:300],
            "eval_correct": "".join("1" if a[0] else "0" for a in answers),  # per prompt, held-out order
        }
        if any(a[4] > 1 for a in answers):
            row["eval_turns_mean"] = sum(a[4] for a in answers) / len(answers)  # multi-turn (--env.name)
        for name, idx in self._by_source().items():  # --data.mix: each source's own accuracy
            part = summarize([[answers[i][0]] for i in idx])
            row[f"eval_accuracy@{name}"], row[f"eval_n@{name}"] = part["accuracy"], len(idx)
        self.results.append({"step": run["step"], **row})
        return {"step": run["step"], **row}

    def _by_source(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, p in enumerate(self.prompts):
            if "mix_source" in p.meta:
                out.setdefault(p.meta["mix_source"], []).append(i)
        return out


def eval_line(step: int, row: dict) -> str:
    """The console line of one finished evaluation (with its 95% Wilson interval)."""
    return (
        f"eval at step {step}: held-out accuracy {_acc(row)} on {row['eval_n']} prompts (greedy, mean length "
        f"{row['eval_response_len_mean']:.0f})"
    )


def gain_line(first: dict, last: dict) -> str:
    """The run's closing line: first and last held-out accuracy, each with its interval."""
    return (
        f"held-out accuracy {_acc(first)} (step {first['step']}) -> {_acc(last)} (step {last['step']}) on "
        f"{last['eval_n']} prompts: gain {last['eval_accuracy'] - first['eval_accuracy']:+.3f}"
    )


def _acc(row: dict) -> str:
    from staleflow.eval.scoring import interval_text

    return interval_text(row["eval_accuracy"], row["eval_ci95_low"], row["eval_ci95_high"])
