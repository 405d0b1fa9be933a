"""Console progress of a training run (rich): a bar with step, reward, tokens/s, staleness, pulls, interrupts.

On a terminal the bar updates in place; otherwise (logs, CI) one line is printed per step.
"""

from __future__ import annotations

import sys


class ProgressDisplay:
    def __init__(self, total_steps: int, enabled: bool = True, start: int = 0):
        self.enabled = enabled
        self.total = total_steps
        self._progress = None
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(file=sys.stdout)
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start, info="waiting for the first buffer"
            )
            self._progress.start()

    @staticmethod
    def format(step: int, total: int, m: dict) -> str:
        return (
            f"step {step}/{total}  reward {m['reward_mean']:.3f}  acc {m['accuracy']:.2f}  "
            f"tok/s {m['tokens_per_s']:.0f}  staleness {m['staleness_mean']:.2f} (max {m['staleness_max']})  "
            f"len {m['response_len_mean']:.0f}  pulls {m['pulls']}  interrupts {m['interrupts']}  "
            f"train {m['train_s']:.1f}s"
            + (
                f"  REWARD ERRORS {m['reward_errors']} (first: {m.get('reward_first_error', '')[:80]})"
                if m.get("reward_errors")
                else ""
            )
        )

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        line = self.format(step, self.total, metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=line.split("  ", 1)[1])
        else:
            self.console.print(line, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
