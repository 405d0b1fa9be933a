"""The console line of a training step, and the progress bar above it (rich, on a terminal only).

    step 3 (4/20)  trained 8 groups, 32 responses, 541 tokens (mean len 16.9)  reward 0.312  acc 0.28  ...
    step 4 (5/20)  trained 8 groups, 32 responses, 512 tokens (mean len 16.0)  ...  -- learned nothing: ...

The step number is metrics.jsonl's ``step`` (the buffer version trained, from 0; an evaluation "at step
k" scores the policy that step k starts from); the parenthesis counts the steps done. Every line says
what the step trained and, when it could learn nothing, why (``nothing_learned``). The lines are
printed whether or not the bar is on (``--log.no-progress`` drops only the bar); without a terminal
(a log file, CI) there is no bar.
"""

from __future__ import annotations

import sys


def nothing_learned(row: dict) -> str | None:
    """Why a step's policy loss had nothing to learn from, or None: dynamic sampling dropped every group,
    or every group's rewards were equal (every group-relative advantage is 0)."""
    train = row.get("train") or {}
    groups = row.get("trained_groups", 0)
    if not groups:
        return "the buffer held no group"
    if train.get("samples_trained", 1) == 0:
        dropped = int(train.get("groups_dropped", groups))
        return f"dynamic sampling dropped all {dropped} groups (the rewards within each group were all equal)"
    if train.get("advantage_abs_mean", 1.0) == 0.0:
        return (
            f"the rewards within every group were equal (mean {row.get('reward_mean', 0.0):.3f}): every advantage is 0"
        )
    return None


def step_line(step: int, total: int, m: dict) -> str:
    """The console line of step ``step`` (0-based, as in metrics.jsonl) of ``total``."""
    n, tokens = m.get("trained_trajectories", 0), m.get("trained_tokens", 0)
    train = m.get("train") or {}
    dropped = int(train.get("groups_dropped", 0))
    line = (
        f"step {step} ({step + 1}/{total})  trained {m.get('trained_groups', 0)} groups, {n} responses, {tokens} tokens "
        f"(mean len {tokens / max(n, 1):.1f})  reward {m['reward_mean']:.3f}  acc {m['accuracy']:.2f}  "
        f"tok/s {m['tokens_per_s']:.0f}  staleness {m['staleness_mean']:.2f} (max {m['staleness_max']})  "
        f"pulls {m['pulls']}  interrupts {m['interrupts']}  train {m['train_s']:.1f}s"
    )
    why = nothing_learned(m)
    if why:
        line += f"  -- learned nothing: {why}"
    elif dropped:
        line += f"  (dynamic sampling dropped {dropped} groups with equal rewards)"
    if m.get("reward_errors"):
        line += f"  REWARD ERRORS {m['reward_errors']} (first: {m.get('reward_first_error', '')[:80]})"
    return line


class ProgressDisplay:
    """One line per step on stdout; a bar under them when ``bar`` and stdout is a terminal."""

    def __init__(self, total_steps: int, bar: bool = True, start: int = 0):
        from rich.console import Console

        self.total = total_steps
        self.console = Console(file=sys.stdout)
        self._progress = None
        if bar and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]steps done"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start)
            self._progress.start()

    def update(self, step: int, metrics: dict) -> None:
        """Step ``step`` (0-based) is done: its line, and the bar moved to step + 1 steps done."""
        self.console.print(step_line(step, self.total, metrics), highlight=False, soft_wrap=True)
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
