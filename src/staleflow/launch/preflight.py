"""Checks of a run's inputs that need no model weights (called by ``staleflow check``, launch/check.py):

- data: every source of --data.source / --data.mix is read whole and judged as the run will
  (bad rows, unscorable answers, prompts over --data.max-prompt-tokens), with a summary line per
  source; --data.bad-rows error refuses the first bad row, and a source without a usable row is
  refused (a built-in or fork task: its first rows are generated); the longest usable prompt plus
  --rollout.max-new-tokens fits --rollout.max-model-len, which fits the model's own
  max_position_embeddings (config.json);
- engine and extras: --rollout.engine resolves to a backend (staleflow.engines) and the optional
  packages the flags ask for are installed (the engine's extras, wandb, flash-attn);
- GPUs: on CUDA, no more trainer ranks than GPUs (NCCL puts one rank on one GPU).
Each refusal is one ConfigError line; launch.sh then exits 2 before torchrun starts a rank.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from staleflow.config import ConfigError, RunConfig

PROBE_ROWS = 8
"""Prompts generated from each task (a data source is read whole)."""


def check_data(cfg: RunConfig, folder: str) -> None:
    """Every data source read WHOLE and judged as the run will judge it (bad rows with --data.bad-rows,
    unscorable answers, prompts over --data.max-prompt-tokens), with a one-line summary per source on
    stderr; and the lengths consistent (module docstring)."""
    import sys

    from staleflow.data import DataError
    from staleflow.data.render import PromptRenderer
    from staleflow.data.tasks import task_for
    from staleflow.env import env_schemas
    from staleflow.model import load_tokenizer

    try:
        tools = env_schemas(cfg.env)  # the prompts of a multi-turn run show its tools: longer
        renderer = PromptRenderer(cfg.data, load_tokenizer(folder), tools, cfg.env.tool_format)
        longest = 0
        for name, _ in cfg.data.sources:
            task = task_for(name)
            if task is not None:
                from staleflow.reward.functions import answer_problem

                probe = [task(cfg.data.seed, k) for k in range(PROBE_ROWS)]
                for _, answer, meta in probe:
                    if (why := answer_problem(cfg.reward.fn, answer, meta)) is not None:
                        raise ConfigError(f"--data.source={name!r}: {why}")
                ids = renderer.encode([text for text, _, _ in probe])
                longest = max(longest, *(len(x) for x in ids))
                continue
            summary, bad, usable, source_longest = data_summary(name, cfg, renderer)
            if bad and cfg.data.bad_rows == "error":
                raise ConfigError(
                    f"bad data row {bad[0].location}: {bad[0].reason}; fix the row or pass --data.bad-rows skip "
                    f"({summary})"
                )
            if not usable:
                first = f"; row {bad[0].location}: {bad[0].reason}" if bad else " (it is empty)"
                raise ConfigError(f"--data.source={name!r}: none of its {len(bad)} rows is usable{first} ({summary})")
            print(f"staleflow: {summary}", file=sys.stderr, flush=True)
            longest = max(longest, source_longest)
    except DataError as e:
        raise ConfigError(str(e)) from None
    check_lengths(cfg, longest, folder)


def data_summary(name: str, cfg: RunConfig, renderer) -> tuple[str, list, int, int]:
    """(the summary line, the bad rows, usable rows, the longest usable prompt in tokens) of a data
    source read whole: rows, bad rows by reason with the first row number of each, the answer field."""
    import collections

    from staleflow.data.files import BadRow, read_rows
    from staleflow.reward.functions import answer_problem

    rows, bad, blank = read_rows(name, cfg.data)
    usable, longest = [], 0
    for row in rows:
        why = answer_problem(cfg.reward.fn, row.answer, row.meta)
        if why is not None:
            bad.append(BadRow(row.location, "unscorable", why))
        else:
            usable.append(row)
    kept = 0
    for start in range(0, len(usable), 1024):
        chunk = usable[start : start + 1024]
        for row, ids in zip(chunk, renderer.encode([r.messages or r.text for r in chunk])):
            if len(ids) > cfg.data.max_prompt_tokens:
                bad.append(BadRow(row.location, "too_long", f"prompt has {len(ids)} tokens > --data.max-prompt-tokens"))
            else:
                kept += 1
                longest = max(longest, len(ids))
    bad.sort(key=lambda b: int(b.location.rsplit(":", 1)[1]))
    firsts: dict[str, str] = {}
    for b in bad:
        firsts.setdefault(b.kind, b.location.rsplit(":", 1)[1])
    counts = collections.Counter(b.kind for b in bad)
    kinds = ", ".join(f"{k} {n} (first row {firsts[k]})" for k, n in sorted(counts.items()))
    fields = collections.Counter(r.answer_field for r in usable)
    answer = ", ".join(f"{f} ({n} row{'s' if n > 1 else ''})" for f, n in fields.most_common()) or "none"
    summary = (
        f"data {name}: {len(rows) + sum(1 for b in bad if b.kind not in ('unscorable', 'too_long'))} rows read"
        f"{f' ({blank} blank lines)' if blank else ''}, {kept} usable, {len(bad)} bad"
        f"{': ' + kinds if kinds else ''}; answer field: {answer}; --data.bad-rows {cfg.data.bad_rows}"
    )
    return summary, bad, kept, longest


def check_lengths(cfg: RunConfig, longest_prompt: int, folder: str) -> None:
    r = cfg.rollout
    if r.max_new_tokens >= r.max_model_len:
        raise ConfigError(
            f"--rollout.max-new-tokens={r.max_new_tokens} leaves no room for a prompt in "
            f"--rollout.max-model-len={r.max_model_len}: lower the first or raise the second"
        )
    if longest_prompt + r.max_new_tokens > r.max_model_len:
        raise ConfigError(
            f"a prompt of {longest_prompt} tokens (among the first rows of the data) + --rollout.max-new-tokens="
            f"{r.max_new_tokens} > --rollout.max-model-len={r.max_model_len}: raise --rollout.max-model-len "
            f"or lower --rollout.max-new-tokens"
        )
    try:
        limit = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        limit = None
    if isinstance(limit, int) and not isinstance(limit, bool) and r.max_model_len > limit:
        raise ConfigError(
            f"--rollout.max-model-len={r.max_model_len} > the model's max_position_embeddings={limit} "
            f"(config.json of {folder}): lower --rollout.max-model-len"
        )


def check_extras(cfg: RunConfig) -> None:
    """--rollout.engine resolves (ExtensionError otherwise) and the optional packages the run's flags need are installed."""
    from staleflow.engines import engine_backend

    wanted = [(module, f"--rollout.engine {cfg.rollout.engine}", fix) for module, fix in engine_backend(cfg).extras]
    if cfg.log.wandb:
        wanted.append(("wandb", "--log.wandb", "pip install 'staleflow[wandb]' (or drop --log.wandb)"))
    if cfg.rollout.decode_backend == "flash":
        wanted.append(("flash_attn", "--rollout.decode-backend flash", "pip install flash-attn on a CUDA machine"))
    for module, flag, fix in wanted:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs the package {module}, which is not installed: {fix}")


def check_gpus(cfg: RunConfig, nproc: int, cuda_devices: int) -> None:
    """On CUDA: at most one trainer rank per GPU (NCCL cannot put two ranks of its group on one GPU)."""
    trainers = nproc - cfg.rollout.ranks
    if cuda_devices and trainers > cuda_devices:
        raise ConfigError(
            f"{nproc} processes with --rollout.ranks={cfg.rollout.ranks} make {trainers} trainer ranks but "
            f"this machine has {cuda_devices} GPU(s): set NPROC <= {cuda_devices + cfg.rollout.ranks} "
            f"or raise --rollout.ranks"
        )
