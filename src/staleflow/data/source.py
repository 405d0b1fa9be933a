"""PromptSource: an endless, seeded, resumable stream of tokenised prompts for the controller.

    source = PromptSource(cfg.data, tokenizer)     # a task, a file, a folder, a hub dataset, or a mix
    prompt = next(source)                          # Prompt(prompt_id, text, answer, prompt_ids, meta)
    state = source.state_dict()                    # checkpoint it; later:
    source.load_state_dict(state)                  # the same next prompts as before

- Tasks (data/tasks.py: the built-ins, or a fork's 'package.module:name') are infinite: prompt k is
  generated from (seed, k); a row that is not (non-empty text, answer, meta dict) is a DataError.
- Data sources (data/files.py) are read and validated once; then epoch e visits every valid row
  once, in an order shuffled by (seed, e). Bad rows are reported (logging warning + stats()) with
  their source:row and skipped, or raise DataError with bad_rows="error". Never silently dropped.
- A mix (--data.mix a:0.7,b:0.3) draws prompt k from source i with probability w_i / sum(w): the
  draw is a pure function of (seed, k), so it is identical after a resume. Each prompt's meta
  names its source (``mix_source``); held-out prompts are split across sources by weight.
- prompt_ids: a string prompt becomes [system message (--data.system-prompt)] + the user message
  (--data.prompt-template around it); a chat-message prompt is used as is; then the tokenizer's own
  chat template with the generation prompt (chat_template=True), else the raw text with the
  tokenizer's special tokens. Prompts over max_prompt_tokens (counted after the template) are bad rows.
- prompt_id counts prompts handed out (0, 1, 2, ... over all epochs): unique within a run.
"""

from __future__ import annotations

import collections
import logging
import random

from staleflow.config import DataConfig
from staleflow.data.files import BadRow, DataError
from staleflow.data.render import PromptRenderer
from staleflow.data.stream import MAX_HELD_OUT_SKIPS, Stream
from staleflow.trajectory import Prompt

log = logging.getLogger("staleflow.data")
__all__ = ["MAX_HELD_OUT_SKIPS", "PromptSource"]


class PromptSource:
    """Endless iterator of Prompt; see the module docstring."""

    def __init__(self, cfg: DataConfig, tokenizer, answer_check=None, tools: list[dict] = (), tool_format="auto"):
        """answer_check(answer, meta) -> why the run's reward cannot score it, or None (a file row whose
        answer fails it is a bad row, reported with its row number like any other); tools: the tool
        schemas every prompt shows (a multi-turn run: staleflow.env.env_schemas(cfg.env))."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.renderer = PromptRenderer(cfg, tokenizer, tools, tool_format)
        specs = cfg.sources
        self.mixed = len(specs) > 1 or bool(cfg.mix)
        self.streams = [Stream(name, cfg, self.encode, answer_check, self.mixed) for name, _ in specs]
        total = sum(w for _, w in specs)
        self.weights = [w / total for _, w in specs]
        self._next_id = 0

    # ---- compatibility views of a single source --------------------------------------------------

    @property
    def task(self):
        return self.streams[0].task if len(self.streams) == 1 else None

    @property
    def rows(self):
        return [r for s in self.streams for r in s.rows]

    @property
    def bad_rows(self) -> list[BadRow]:
        return [b for s in self.streams for b in s.bad_rows]

    # ---- held out --------------------------------------------------------------------------------

    def hold_out(self, n: int) -> list[Prompt]:
        """Set aside n prompts for evaluation, never trained on; call before drawing any prompt.
        In a mix each source gives round(n * weight) of them (at least 1)."""
        if n <= 0:
            return []
        if self._next_id:
            raise DataError("hold_out must be called before any training prompt is drawn")
        counts = [n] if len(self.streams) == 1 else [max(1, round(n * w)) for w in self.weights]
        rows = [row for s, k in zip(self.streams, counts) for row in s.hold_out(k)]
        ids = self.encode([prompt for _, _, _, prompt in rows])
        return [
            Prompt(-(i + 1), text, answer, pid, meta) for i, ((text, answer, meta, _), pid) in enumerate(zip(rows, ids))
        ]

    # ---- iteration -------------------------------------------------------------------------------

    def __iter__(self):
        return self

    def pick(self, prompt_id: int) -> int:
        """The source prompt `prompt_id` is drawn from: a pure function of (seed, prompt_id)."""
        if len(self.streams) == 1:
            return 0
        u = random.Random(f"mix:{self.cfg.seed}:{prompt_id}").random()
        acc = 0.0
        for i, w in enumerate(self.weights):
            acc += w
            if u < acc:
                return i
        return len(self.weights) - 1

    def __next__(self) -> Prompt:
        stream = self.streams[self.pick(self._next_id)]
        text, answer, meta, prompt = stream.next_row()
        ids = self.encode([prompt])[0]
        if len(ids) > self.cfg.max_prompt_tokens:  # files were checked at load: a built-in prompt
            raise DataError(
                f"built-in task {stream.name!r} prompt {meta.get('index')} has {len(ids)} tokens > "
                f"--data.max-prompt-tokens={self.cfg.max_prompt_tokens}: raise the limit"
            )
        out = Prompt(self._next_id, text, answer, ids, meta)
        self._next_id += 1
        return out

    def take(self, n: int) -> list[Prompt]:
        """The next n prompts."""
        return [next(self) for _ in range(n)]

    def encode(self, prompts: list) -> list[list[int]]:
        """Token ids of prompts (strings or chat-message tuples) as the policy sees them (data/render.py)."""
        return self.renderer.encode(prompts)

    # ---- resumable position ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        first = self.streams[0].state_dict()
        state = {
            "source": self.cfg.mix or self.cfg.source,
            "seed": self.cfg.seed,
            "num_rows": sum(len(s.rows) for s in self.streams),
            "next_id": self._next_id,
            **{k: first[k] for k in ("epoch", "offset", "index")},
        }
        if len(self.streams) > 1:
            state["streams"] = [s.state_dict() for s in self.streams]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue where the saved source stopped; DataError if it read different data."""
        mine = self.state_dict()
        for key in ("source", "seed", "num_rows"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"cannot resume the prompt source: the checkpoint has {key}={state.get(key)!r} "
                    f"but this run has {key}={mine[key]!r}; resume with the same --data settings and file"
                )
        self._next_id = int(state["next_id"])
        saved = state.get("streams") or [
            {"epoch": state["epoch"], "offset": state["offset"], "index": state.get("index", self._next_id)}
        ]
        for s, st in zip(self.streams, saved):
            s.load_state_dict(st)

    def stats(self) -> dict:
        kinds = collections.Counter(b.kind for b in self.bad_rows)
        return {
            "source": self.cfg.mix or self.cfg.source,
            "rows": len(self.rows),
            "bad_rows": len(self.bad_rows),
            "bad_rows_by_kind": dict(kinds),
            "blank_lines": sum(s.blank_lines for s in self.streams),
            "prompts": self._next_id,
            "epoch": max(s.epoch for s in self.streams),
        }
