"""Typed readers of a run folder's records for the analysis scripts (scripts/compare_runs.py,
bench_convergence.py --no-run): every field they read is checked for type and range before use.

    trained = read_records(run / "trained.jsonl", TRAINED)     # [dict]; RecordError (one line) otherwise
    steps = read_records(run / "metrics.jsonl", METRICS)       # step rows and evaluation rows
    seed = read_seed(run)                                      # config.json's seed, or None
    cfg = read_config(run)                                     # config.json (a dict), or None

A run folder can come from another machine or another person (an --archive, a shared folder): a
crafted record (empty ``rewards``, a string where a number goes, NaN times, 1e30 token counts, lines
nested 100,000 deep) is one RecordError naming the file, the line and the field, never a traceback
and never a silently absurd table. Lines that do not parse at all (torn by a crash, too deep) are
skipped as every reader of these logs skips them (staleflow.durable); superseded rows are left out.
"""

from __future__ import annotations

import math
from pathlib import Path

from staleflow.inputs import InputError, load_json, read_capped

MAX_LOG_BYTES = 1 << 31
BIG = 1 << 40
"""Counts, versions and ids are integers in [0, BIG]."""
SECONDS = 1e9
"""Times and durations are finite and within +-SECONDS (30 years)."""
VALUE = 1e12
"""Any other number a record holds: finite and within +-VALUE."""


class RecordError(ValueError):
    """A record that does not have the fields and ranges its reader needs; one line."""


def integer(lo: int = 0, hi: int = BIG):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            return f"an integer in [{lo}, {hi}]"
        return None

    return check


def number(lo: float = -VALUE, hi: float = VALUE):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            return f"a finite number in [{lo:g}, {hi:g}]"
        return None

    return check


def list_of(item, lo: int = 0, hi: int = 1 << 20):
    def check(v):
        if not isinstance(v, list) or not lo <= len(v) <= hi:
            return f"a list of {lo} to {hi} items"
        for x in v:
            if (why := item(x)) is not None:
                return f"a list whose items are each {why}"
        return None

    return check


def pair(first, second):
    def check(v):
        if not isinstance(v, list) or len(v) != 2:
            return "a [a, b] pair"
        return first(v[0]) or second(v[1])

    return check


def mapping(value):
    def check(v):
        if not isinstance(v, dict) or len(v) > 1 << 16:
            return "an object"
        for x in v.values():
            if (why := value(x)) is not None:
                return f"an object whose values are each {why}"
        return None

    return check


def text(hi: int = 1 << 20):
    return lambda v: None if isinstance(v, str) and len(v) <= hi else f"a string of at most {hi} characters"


COUNT, SECS, NUM = integer(), number(-SECONDS, SECONDS), number()
TRAINED = {
    "buffer": COUNT,
    "group_id": COUNT,
    "traj_version": COUNT,
    "rewards": list_of(number(-1e6, 1e6), 1, 1 << 16),
    "prompt_id": lambda v: None if v is None else COUNT(v),
    "n_tokens": list_of(integer(0, 1 << 31), 0, 1 << 16),
    "token_versions": list_of(list_of(pair(COUNT, integer(0, 1 << 31))), 0, 1 << 16),
    "submitted_s": SECS,
}
"""trained.jsonl: one row per trained group (the fields the scripts read; required: the first four)."""
STEP = {
    "step": COUNT,
    "time": SECS,
    "train_s": SECS,
    "push_s": SECS,
    "trained_tokens": integer(0, 1 << 40),
    "reward_mean": NUM,
    "accuracy": number(0, 1),
    "interrupts": COUNT,
    "migrations": COUNT,
    "pulls": COUNT,
    "groups_aborted": COUNT,
    "occupy_exchanges": COUNT,
    "order_swaps": COUNT,
    "staleness_hist": mapping(COUNT),
    "train": mapping(NUM),
}
EVAL = {
    "step": COUNT,
    "time": SECS,
    "eval_n": integer(1),
    "eval_accuracy": number(0, 1),
    "eval_ci95_low": number(0, 1),
    "eval_ci95_high": number(0, 1),
    "eval_correct": lambda v: None if v is None else text()(v),
    "eval_s": SECS,
}
TIMELINE = {"rank": COUNT, "kind": text(64), "t0": SECS, "t1": SECS}
"""timeline.jsonl: one span of one rank's activity (metrics/writer.py log_span)."""
REQUIRED = {
    "trained": ("buffer", "group_id", "traj_version", "rewards"),
    "step": ("step", "time"),
    "eval": ("step", "time", "eval_n", "eval_accuracy", "eval_ci95_low", "eval_ci95_high"),
    "timeline": ("rank", "kind", "t0", "t1"),
}


def check_record(row, fields: dict, required, where: str) -> dict:
    """``row`` with every field of ``fields`` it holds checked; RecordError naming ``where`` and the field."""
    if not isinstance(row, dict):
        raise RecordError(f"{where}: a record must be a JSON object")
    for key in required:
        if key not in row:
            raise RecordError(f"{where}: field {key!r} is missing")
    for key, check in fields.items():
        if key in row and (why := check(row[key])) is not None:
            raise RecordError(f"{where}: field {key!r} = {str(row[key])[:60]!r} must be {why}")
    return row


def _lines(path: Path):
    try:
        data = read_capped(path, MAX_LOG_BYTES)
    except InputError as e:
        raise RecordError(str(e)) from None
    from staleflow.inputs import loads_json

    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            row = loads_json(raw, f"{path}:{lineno}")
        except InputError:
            continue  # torn by a crash or nested too deeply: skipped, as every reader of these logs does
        if isinstance(row, dict) and row.get("superseded"):
            continue
        yield lineno, row


def read_trained(path: Path) -> list[dict]:
    """trained.jsonl, typed (TRAINED)."""
    return [check_record(r, TRAINED, REQUIRED["trained"], f"{path}:{n}") for n, r in _lines(path)]


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl, typed: step rows (STEP) and evaluation rows (EVAL, those with eval_n)."""
    out = []
    for n, r in _lines(path):
        is_eval = isinstance(r, dict) and "eval_n" in r
        kind = "eval" if is_eval else "step"
        out.append(check_record(r, EVAL if is_eval else STEP, REQUIRED[kind], f"{path}:{n}"))
    return out


def read_timeline(path: Path) -> list[dict]:
    """timeline.jsonl, typed (TIMELINE); a span that ends before it starts is a RecordError."""
    out = []
    for n, r in _lines(path):
        row = check_record(r, TIMELINE, REQUIRED["timeline"], f"{path}:{n}")
        if row["t1"] < row["t0"]:
            raise RecordError(f"{path}:{n}: span ends ({row['t1']}) before it starts ({row['t0']})")
        out.append(row)
    return out


def read_config(run: Path) -> dict | None:
    """config.json as a JSON object (its size capped by load_json), None when there is none."""
    path = run / "config.json"
    if not path.exists():
        return None
    try:
        cfg = load_json(path)
    except InputError as e:
        raise RecordError(str(e)) from None
    if not isinstance(cfg, dict):
        raise RecordError(f"{path}: not a JSON object")
    return cfg


def read_seed(run: Path, cfg: dict | None = None):
    """config.json's top-level seed (an integer) or None when there is no config.json; ``cfg``: the
    config.json already read (read_config), so that it is read once."""
    cfg = read_config(run) if cfg is None else cfg
    seed = cfg.get("seed") if cfg is not None else None
    if seed is not None and integer(0, 1 << 63)(seed) is not None:
        raise RecordError(f"{run / 'config.json'}: field 'seed' = {str(seed)[:40]!r} must be an integer")
    return seed


def read_object(path: Path, fields: dict, required: tuple) -> dict:
    """A JSON object file (bench.json), typed."""
    try:
        obj = load_json(path)
    except InputError as e:
        raise RecordError(str(e)) from None
    return check_record(obj, fields, required, str(path))
