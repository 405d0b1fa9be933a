"""One source of a PromptSource: a task (infinite, generated) or the validated rows of a data source
(epochs in a seeded order). Rows come out as (text, answer, meta, prompt) where prompt is what gets
encoded: the text, or the chat messages ((role, content), ...)."""

from __future__ import annotations

import collections
import logging
import random

from staleflow.config import DataConfig
from staleflow.data.files import BadRow, DataError, FileRow, read_rows
from staleflow.data.tasks import task_for
from staleflow.extensions import one_line

log = logging.getLogger("staleflow.data")
MAX_LOGGED_BAD_ROWS = 20
MAX_HELD_OUT_SKIPS = 10000
"""A task whose next this-many rows all repeat held-out (or already drawn held-out) texts has run dry."""
_ENCODE_BATCH = 1024


def _row_number(location: str) -> int:
    return int(location.rsplit(":", 1)[1])


class Stream:
    def __init__(self, name: str, cfg: DataConfig, encode, answer_check, tagged: bool):
        self.name, self.cfg, self.encode, self.answer_check = name, cfg, encode, answer_check
        self.tag = {"mix_source": name} if tagged else {}
        self.task = task_for(name)
        self.rows: list[FileRow] = []
        self.bad_rows: list[BadRow] = []
        self.blank_lines = 0
        if self.task is None:
            self._load()
        elif answer_check is not None:  # a task's rows are all alike: its first row says whether the reward fits
            _, answer, meta = self.task(cfg.seed, 0)
            if (why := answer_check(answer, meta)) is not None:
                raise DataError(f"--data.source={name!r}: {why}")
        self.epoch = 0
        self._offset = 0
        self._order: list[int] = []
        self._order_epoch = -1
        self._held_out_texts: set[str] = set()
        self._index = 0  # tasks: next row to generate (skips held-out prompts)

    def hold_out(self, n: int) -> list[tuple]:
        """n rows set aside for evaluation. A data source gives up n rows (a seeded choice) that
        training never reads. A task draws them from its own stream (negative row indices) and
        training skips any row whose text is one of them (the same question can come up again)."""
        if self.task is not None:
            rows, k = [], 0
            while len(rows) < n:
                k += 1
                if k > n + MAX_HELD_OUT_SKIPS:
                    raise DataError(
                        f"--data.source={self.name!r} gave {len(rows)} distinct prompts in {k - 1} "
                        f"rows: too few to hold out --eval.n={n}; lower --eval.n"
                    )
                text, answer, meta = self._task_row(-k)
                if text not in self._held_out_texts:
                    self._held_out_texts.add(text)
                    rows.append((text, answer, {**meta, **self.tag, "held_out": True}, text))
            return rows
        if len(self.rows) < 2 * n:
            raise DataError(
                f"--data.source={self.name!r} has {len(self.rows)} valid rows: too few to hold "
                f"out --eval.n={n} for evaluation and train on the rest (need >= {2 * n})"
            )
        picked = sorted(random.Random(f"held-out:{self.cfg.seed}").sample(range(len(self.rows)), n))
        chosen = set(picked)
        out = [self._out(self.rows[i], {"held_out": True}) for i in picked]
        self.rows = [r for i, r in enumerate(self.rows) if i not in chosen]
        return out

    def _out(self, row: FileRow, extra: dict) -> tuple:
        return row.text, row.answer, {**row.meta, **self.tag, **extra}, row.messages or row.text

    def next_row(self) -> tuple:
        if self.task is not None:
            for _ in range(MAX_HELD_OUT_SKIPS):  # a held-out question is never trained on
                index = self._index
                self._index += 1
                text, answer, meta = self._task_row(index)
                if text not in self._held_out_texts:
                    break
            else:
                raise DataError(
                    f"--data.source={self.name!r}: rows {index - MAX_HELD_OUT_SKIPS + 1}..{index} "
                    f"are all held-out prompts; the task has no training prompts left (lower --eval.n)"
                )
            return text, answer, {**meta, **self.tag, "index": index}, text
        if self._offset == len(self.rows):
            self.epoch, self._offset = self.epoch + 1, 0
        index = self._epoch_order()[self._offset]
        self._offset += 1
        return self._out(self.rows[index], {"index": index, "epoch": self.epoch})

    def _task_row(self, index: int) -> tuple[str, str, dict]:
        """Row `index` of the task, checked: a fork's task function may return anything."""
        row = self.task(self.cfg.seed, index)
        ok = isinstance(row, tuple) and len(row) == 3 and isinstance(row[0], str) and bool(row[0].strip())
        ok = ok and isinstance(row[1], (str, int, float)) and not isinstance(row[1], bool) and bool(str(row[1]).strip())
        if not (ok and isinstance(row[2], dict)):
            raise DataError(
                f"--data.source={self.name!r} row {index} is {one_line(repr(row))[:200]}; a task "
                f"returns (prompt text, answer, meta dict) with a non-empty text and answer"
            )
        return row[0], str(row[1]), row[2]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self._offset, "index": self._index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._offset, self._index = int(state["epoch"]), int(state["offset"]), int(state["index"])

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = list(range(len(self.rows)))
            random.Random(f"order:{self.cfg.seed}:{self.epoch}").shuffle(self._order)
            self._order_epoch = self.epoch
        return self._order

    def _load(self) -> None:
        cfg = self.cfg
        rows, bad, self.blank_lines = read_rows(self.name, cfg)
        if self.answer_check is not None:
            scorable = []
            for row in rows:
                why = self.answer_check(row.answer, row.meta)
                if why is None:
                    scorable.append(row)
                else:
                    bad.append(BadRow(row.location, "unscorable", why))
            rows = scorable
        if bad and cfg.bad_rows == "error":
            bad.sort(key=lambda b: _row_number(b.location))
            self._reject(bad[0])
        keep: list[FileRow] = []
        for start in range(0, len(rows), _ENCODE_BATCH):
            chunk = rows[start : start + _ENCODE_BATCH]
            for row, ids in zip(chunk, self.encode([r.messages or r.text for r in chunk])):
                if len(ids) <= cfg.max_prompt_tokens:
                    keep.append(row)
                    continue
                too_long = BadRow(
                    row.location,
                    "too_long",
                    f"prompt has {len(ids)} tokens > --data.max-prompt-tokens={cfg.max_prompt_tokens}",
                )
                if cfg.bad_rows == "error":
                    self._reject(too_long)
                bad.append(too_long)
        bad.sort(key=lambda b: _row_number(b.location))
        self.rows, self.bad_rows = keep, bad
        for b in bad[:MAX_LOGGED_BAD_ROWS]:
            log.warning("skipping bad data row %s: %s", b.location, b.reason)
        if bad:
            log.warning(
                "%s: skipped %d bad rows of %d (%s)%s",
                self.name,
                len(bad),
                len(bad) + len(keep),
                ", ".join(f"{k}: {n}" for k, n in sorted(collections.Counter(b.kind for b in bad).items())),
                f"; only the first {MAX_LOGGED_BAD_ROWS} are listed above" if len(bad) > MAX_LOGGED_BAD_ROWS else "",
            )
        if not keep:
            first = f"; first bad row {bad[0].location}: {bad[0].reason}" if bad else ""
            raise DataError(
                f"--data.source={self.name!r} has no valid rows ({len(bad)} bad, {self.blank_lines} blank lines){first}"
            )

    def _reject(self, bad: BadRow) -> None:
        raise DataError(f"bad data row {bad.location}: {bad.reason}; fix the row or pass --data.bad-rows skip")
