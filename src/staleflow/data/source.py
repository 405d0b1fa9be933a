"""PromptSource: an endless, seeded, resumable stream of tokenised prompts for the controller.

    source = PromptSource(cfg.data, tokenizer)     # built-in task or .jsonl / .parquet file
    prompt = next(source)                          # Prompt(prompt_id, text, answer, prompt_ids, meta)
    state = source.state_dict()                    # checkpoint it; later:
    source.load_state_dict(state)                  # the same next prompts as before

- Tasks (data/tasks.py: the built-ins, or a fork's 'package.module:name') are infinite: prompt k is
  generated from (seed, k); a row that is not (non-empty text, answer, meta dict) is a DataError.
- Files are read and validated once; then epoch e visits every valid row once, in an order
  shuffled by (seed, e). Bad rows are reported (logging warning + stats()) with their
  file:row and skipped, or raise DataError with bad_rows="error". Never silently dropped.
- prompt_ids = the chat template of the tokenizer applied to one user message with the
  generation prompt (chat_template=True), else the raw text with the tokenizer's special tokens.
  Prompts over max_prompt_tokens (counted after the template) are bad rows.
- prompt_id counts prompts handed out (0, 1, 2, ... over all epochs): unique within a run.
"""

from __future__ import annotations

import collections
import logging
import random

from staleflow.config import DataConfig
from staleflow.data.files import BadRow, DataError, FileRow, read_rows, resolve_file
from staleflow.data.tasks import task_for
from staleflow.extensions import one_line
from staleflow.trajectory import Prompt

log = logging.getLogger("staleflow.data")
MAX_LOGGED_BAD_ROWS = 20
MAX_HELD_OUT_SKIPS = 10000
"""A task whose next this-many rows all repeat held-out (or already drawn held-out) texts has run dry."""
_ENCODE_BATCH = 1024


class PromptSource:
    """Endless iterator of Prompt; see the module docstring."""

    def __init__(self, cfg: DataConfig, tokenizer, answer_check=None):
        """answer_check(answer) -> why the run's reward cannot score it, or None (a file row whose
        answer fails it is a bad row, reported with its row number like any other)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.answer_check = answer_check
        if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "--data.chat-template is on but the tokenizer has no chat template: "
                "use an instruct model folder or pass --data.no-chat-template"
            )
        self.task = task_for(cfg.source)
        self.rows: list[FileRow] = []
        self.bad_rows: list[BadRow] = []
        self._blank_lines = 0
        if self.task is None:
            self._load_file()
        self._next_id = 0
        self._epoch = 0
        self._offset = 0
        self._order: list[int] = []
        self._order_epoch = -1
        self._held_out_texts: set[str] = set()
        self._index = 0  # built-in tasks: next row to generate (skips held-out prompts)

    def hold_out(self, n: int) -> list[Prompt]:
        """Set aside n prompts for evaluation, never trained on; call before drawing any prompt.

        A file gives up n rows (a seeded choice) that training never reads. A built-in task draws
        them from its own stream (negative row indices) and training skips any row whose text is
        one of them (the arithmetic space is small: the same question can come up again)."""
        if n <= 0:
            return []
        if self._next_id:
            raise DataError("hold_out must be called before any training prompt is drawn")
        if self.task is not None:
            rows, k = [], 0
            while len(rows) < n:
                k += 1
                if k > n + MAX_HELD_OUT_SKIPS:
                    raise DataError(
                        f"--data.source={self.cfg.source!r} gave {len(rows)} distinct prompts in {k - 1} "
                        f"rows: too few to hold out --eval.n={n}; lower --eval.n"
                    )
                text, answer, meta = self._task_row(-k)
                if text not in self._held_out_texts:
                    self._held_out_texts.add(text)
                    rows.append((text, answer, {**meta, "held_out": True}))
        else:
            if len(self.rows) < 2 * n:
                raise DataError(
                    f"--data.source={self.cfg.source!r} has {len(self.rows)} valid rows: too few to hold "
                    f"out --eval.n={n} for evaluation and train on the rest (need >= {2 * n})"
                )
            picked = sorted(random.Random(f"held-out:{self.cfg.seed}").sample(range(len(self.rows)), n))
            chosen = set(picked)
            rows = [(self.rows[i].text, self.rows[i].answer, {**self.rows[i].meta, "held_out": True}) for i in picked]
            self.rows = [r for i, r in enumerate(self.rows) if i not in chosen]
        ids = self.encode([text for text, _, _ in rows])
        return [
            Prompt(-(i + 1), text, answer, pid, meta) for i, ((text, answer, meta), pid) in enumerate(zip(rows, ids))
        ]

    # ---- iteration ----------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> Prompt:
        if self.task is not None:
            for _ in range(MAX_HELD_OUT_SKIPS):  # a held-out question is never trained on
                index = self._index
                self._index += 1
                text, answer, meta = self._task_row(index)
                if text not in self._held_out_texts:
                    break
            else:
                raise DataError(
                    f"--data.source={self.cfg.source!r}: rows {index - MAX_HELD_OUT_SKIPS + 1}..{index} "
                    f"are all held-out prompts; the task has no training prompts left (lower --eval.n)"
                )
            meta = {**meta, "index": index}
        else:
            if self._offset == len(self.rows):
                self._epoch, self._offset = self._epoch + 1, 0
            index = self._epoch_order()[self._offset]
            row = self.rows[index]
            text, answer, meta = row.text, row.answer, {**row.meta, "index": index, "epoch": self._epoch}
            self._offset += 1
        ids = self.encode([text])[0]
        if len(ids) > self.cfg.max_prompt_tokens:  # files were checked at load: a built-in prompt
            raise DataError(
                f"built-in task {self.cfg.source!r} prompt {index} has {len(ids)} tokens > "
                f"--data.max-prompt-tokens={self.cfg.max_prompt_tokens}: raise the limit"
            )
        prompt = Prompt(self._next_id, text, answer, ids, meta)
        self._next_id += 1
        return prompt

    def _task_row(self, index: int) -> tuple[str, str, dict]:
        """Row `index` of the task, checked: a fork's task function may return anything."""
        row = self.task(self.cfg.seed, index)
        ok = isinstance(row, tuple) and len(row) == 3 and isinstance(row[0], str) and bool(row[0].strip())
        ok = ok and isinstance(row[1], (str, int, float)) and not isinstance(row[1], bool) and bool(str(row[1]).strip())
        if not (ok and isinstance(row[2], dict)):
            raise DataError(
                f"--data.source={self.cfg.source!r} row {index} is {one_line(repr(row))[:200]}; a task "
                f"returns (prompt text, answer, meta dict) with a non-empty text and answer"
            )
        return row[0], str(row[1]), row[2]

    def take(self, n: int) -> list[Prompt]:
        """The next n prompts."""
        return [next(self) for _ in range(n)]

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of prompts as the policy sees them (chat template applied if configured)."""
        if self.cfg.chat_template:
            rendered = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
            return [list(x) for x in self.tokenizer(rendered, add_special_tokens=False)["input_ids"]]
        return [list(x) for x in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    # ---- resumable position -----------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "source": self.cfg.source,
            "seed": self.cfg.seed,
            "num_rows": len(self.rows),
            "next_id": self._next_id,
            "epoch": self._epoch,
            "offset": self._offset,
            "index": self._index,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where the saved source stopped; DataError if it read different data."""
        mine = self.state_dict()
        for key in ("source", "seed", "num_rows"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"cannot resume the prompt source: the checkpoint has {key}={state.get(key)!r} "
                    f"but this run has {key}={mine[key]!r}; resume with the same --data settings and file"
                )
        self._next_id, self._epoch, self._offset = int(state["next_id"]), int(state["epoch"]), int(state["offset"])
        self._index = int(state.get("index", self._next_id))

    def stats(self) -> dict:
        kinds = collections.Counter(b.kind for b in self.bad_rows)
        return {
            "source": self.cfg.source,
            "rows": len(self.rows),
            "bad_rows": len(self.bad_rows),
            "bad_rows_by_kind": dict(kinds),
            "blank_lines": self._blank_lines,
            "prompts": self._next_id,
            "epoch": self._epoch,
        }

    # ---- files -----------------------------------------------------------------------------

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self._epoch:
            self._order = list(range(len(self.rows)))
            random.Random(f"order:{self.cfg.seed}:{self._epoch}").shuffle(self._order)
            self._order_epoch = self._epoch
        return self._order

    def _load_file(self) -> None:
        path = resolve_file(self.cfg.source)
        rows, bad, self._blank_lines = read_rows(path, self.cfg)
        if self.answer_check is not None:
            scorable = []
            for row in rows:
                why = self.answer_check(row.answer)
                if why is None:
                    scorable.append(row)
                else:
                    bad.append(BadRow(row.location, "unscorable", why))
            rows = scorable
        if bad and self.cfg.bad_rows == "error":
            bad.sort(key=lambda b: int(b.location.rsplit(":", 1)[1]))
            self._reject(bad[0])
        keep: list[FileRow] = []
        for start in range(0, len(rows), _ENCODE_BATCH):
            chunk = rows[start : start + _ENCODE_BATCH]
            for row, ids in zip(chunk, self.encode([r.text for r in chunk])):
                if len(ids) <= self.cfg.max_prompt_tokens:
                    keep.append(row)
                    continue
                too_long = BadRow(
                    row.location,
                    "too_long",
                    f"prompt has {len(ids)} tokens > --data.max-prompt-tokens={self.cfg.max_prompt_tokens}",
                )
                if self.cfg.bad_rows == "error":
                    self._reject(too_long)
                bad.append(too_long)
        bad.sort(key=lambda b: int(b.location.rsplit(":", 1)[1]))
        self.rows, self.bad_rows = keep, bad
        for b in bad[:MAX_LOGGED_BAD_ROWS]:
            log.warning("skipping bad data row %s: %s", b.location, b.reason)
        if bad:
            log.warning(
                "%s: skipped %d bad rows of %d (%s)%s",
                path,
                len(bad),
                len(bad) + len(keep),
                ", ".join(f"{k}: {n}" for k, n in sorted(collections.Counter(b.kind for b in bad).items())),
                f"; only the first {MAX_LOGGED_BAD_ROWS} are listed above" if len(bad) > MAX_LOGGED_BAD_ROWS else "",
            )
        if not keep:
            first = f"; first bad row {bad[0].location}: {bad[0].reason}" if bad else ""
            raise DataError(
                f"--data.source={self.cfg.source!r} has no valid rows "
                f"({len(bad)} bad, {self._blank_lines} blank lines){first}"
            )

    def _reject(self, bad: BadRow) -> None:
        raise DataError(f"bad data row {bad.location}: {bad.reason}; fix the row or pass --data.bad-rows skip")
