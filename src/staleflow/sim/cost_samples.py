"""The cost-samples file: profiled engine steps a device run writes and scripts/fit_cost_model.py refits from.

JSON lines, UTF-8. Line 1 is the header, every later line one engine step:

    {"format": "staleflow-cost-samples", "version": 1, "device": "cuda", "gpu": "NVIDIA H100 80GB HBM3",
     "model": "Qwen/Qwen2.5-7B-Instruct", "weights": "random", "tp": 1, "dtype": "bfloat16", "torch": "2.14.0",
     "engine": "builtin", "decode_backend": "triton", "cuda_graphs": false, "block_size": 16,
     "max_kv_tokens": 100352, "prefill_chunk_tokens": 8192, "cells": [[1, 64, 8], [16, 2048, 8], ...],
     "threads": 16, "date": "2026-12-03", "source": "scripts/bench_engine_shape.py --cost-samples"}
    {"cell": 0, "n_running": 1, "kv_tokens": 64, "prefill_tokens": 64, "latency_s": 0.0213, "warmup": false}

``cells`` are the sweep's (sequences, prompt tokens, decode steps) groups: every request of a cell has
that prompt length and decodes that many tokens after its prefill; a step record names its cell.
A record is the engine's CostSample (rollout/engine.py: sequences that ran this step, KV tokens
attended, prompt tokens prefilled, seconds) plus ``warmup``: the first pure-decode step of a cell, which
the fit skips. ``gpu`` is null on CPU (``cpu`` then names the processor). The reader decodes every
value into its type and range and stops at the first bad line with one line naming the file, the line,
the field and the fix (CostSamplesError); nothing read is executed (plain JSON, NaN/Infinity refused).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from staleflow.rollout.engine import CostSample

FORMAT = "staleflow-cost-samples"
VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")


class CostSamplesError(ValueError):
    """A cost-samples file that cannot be read; the message names the file, the line, the field and the fix."""


@dataclass(frozen=True)
class SamplesHeader:
    device: str
    """'cuda' or 'cpu'."""
    model: str
    """The model whose SHAPE ran (a bundled name, hub id or folder); weights may be random (``weights``)."""
    dtype: str
    torch: str
    cells: tuple[tuple[int, int, int], ...]
    """(sequences, prompt tokens, decode steps) of each sweep cell, in run order."""
    gpu: str | None = None
    """torch.cuda.get_device_name() on CUDA; None on CPU."""
    cpu: str = ""
    weights: str = "random"
    """'random' (normal(0, 0.02) at the model's shape: the cost is the shape's) or 'checkpoint'."""
    tp: int = 1
    engine: str = "builtin"
    decode_backend: str = ""
    cuda_graphs: bool = False
    block_size: int = 16
    max_kv_tokens: int = 0
    prefill_chunk_tokens: int = 0
    threads: int = 0
    date: str = ""
    load_average_1min: float = 0.0
    source: str = ""
    extra: dict = field(default_factory=dict)
    """Free-form notes (strings/numbers) a writer adds; not interpreted."""

    def to_json(self) -> str:
        d = asdict(self)
        d["cells"] = [list(c) for c in self.cells]
        return json.dumps({"format": FORMAT, "version": VERSION, **d})


@dataclass(frozen=True)
class Step:
    """One record: the engine's CostSample, the cell it belongs to and whether the fit skips it."""

    cell: int
    sample: CostSample
    warmup: bool = False

    def to_json(self) -> str:
        s = self.sample
        return json.dumps(
            {
                "cell": self.cell,
                "n_running": s.n_running,
                "kv_tokens": s.kv_tokens,
                "prefill_tokens": s.prefill_tokens,
                "latency_s": s.latency_s,
                "warmup": self.warmup,
            }
        )


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _int(d: dict, key: str, lo: int, hi: int = 1 << 40) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{key}={v!r} must be an integer in [{lo}, {hi}]")
    return v


def _str(d: dict, key: str, choices: tuple[str, ...] = ()) -> str:
    v = d[key]
    if not isinstance(v, str) or (choices and v not in choices):
        raise ValueError(f"{key}={v!r} must be " + (f"one of {', '.join(choices)}" if choices else "a string"))
    return v


def _bool(d: dict, key: str) -> bool:
    if not isinstance(d[key], bool):
        raise ValueError(f"{key}={d[key]!r} must be true or false")
    return d[key]


def _header(d: dict) -> SamplesHeader:
    if d.get("format") != FORMAT or d.get("version") != VERSION:
        raise ValueError(
            f"format={d.get('format')!r} version={d.get('version')!r}: the first line must be a header with "
            f'"format": "{FORMAT}", "version": {VERSION} (written by scripts/bench_engine_shape.py --cost-samples '
            f"or scripts/fit_cost_model.py --save-samples)"
        )
    known = {f for f in SamplesHeader.__dataclass_fields__} | {"format", "version"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown header keys {unknown}")
    for key in ("device", "model", "dtype", "torch", "cells"):
        if key not in d:
            raise ValueError(f"the header lacks {key!r}")
    cells = d["cells"]
    if not isinstance(cells, list) or not cells:
        raise ValueError(f"cells={cells!r} must be a non-empty list of [sequences, prompt tokens, decode steps]")
    parsed = []
    for c in cells:
        if not (isinstance(c, list) and len(c) == 3 and all(type(x) is int and 1 <= x <= 1 << 24 for x in c)):
            raise ValueError(f"cells entry {c!r} must be [sequences, prompt tokens, decode steps], integers >= 1")
        parsed.append(tuple(c))
    gpu = d.get("gpu")
    if gpu is not None and not isinstance(gpu, str):
        raise ValueError(f"gpu={gpu!r} must be a string or null")
    device = _str(d, "device", ("cuda", "cpu"))
    if device == "cuda" and not gpu:
        raise ValueError("device is cuda but gpu (the device name) is missing")
    extra = d.get("extra", {})
    if not isinstance(extra, dict) or not all(
        isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in extra.values()
    ):
        raise ValueError(f"extra={extra!r} must be an object of strings and numbers")
    load = d.get("load_average_1min", 0.0)
    if isinstance(load, bool) or not isinstance(load, (int, float)) or not math.isfinite(load) or load < 0:
        raise ValueError(f"load_average_1min={load!r} must be a number >= 0")
    return SamplesHeader(
        device=device,
        model=_str(d, "model"),
        dtype=_str(d, "dtype", DTYPES),
        torch=_str(d, "torch"),
        cells=tuple(parsed),
        gpu=gpu,
        cpu=_str(d, "cpu") if "cpu" in d else "",
        weights=_str(d, "weights", ("random", "checkpoint")) if "weights" in d else "random",
        tp=_int(d, "tp", 1, 64) if "tp" in d else 1,
        engine=_str(d, "engine") if "engine" in d else "builtin",
        decode_backend=_str(d, "decode_backend") if "decode_backend" in d else "",
        cuda_graphs=_bool(d, "cuda_graphs") if "cuda_graphs" in d else False,
        block_size=_int(d, "block_size", 1, 1 << 16) if "block_size" in d else 16,
        max_kv_tokens=_int(d, "max_kv_tokens", 0) if "max_kv_tokens" in d else 0,
        prefill_chunk_tokens=_int(d, "prefill_chunk_tokens", 0) if "prefill_chunk_tokens" in d else 0,
        threads=_int(d, "threads", 0, 1 << 16) if "threads" in d else 0,
        date=_str(d, "date") if "date" in d else "",
        load_average_1min=float(load),
        source=_str(d, "source") if "source" in d else "",
        extra=extra,
    )


_STEP_KEYS = {"cell", "n_running", "kv_tokens", "prefill_tokens", "latency_s", "warmup"}


def _step(d: dict, n_cells: int) -> Step:
    if set(d) != _STEP_KEYS:
        missing, unknown = sorted(_STEP_KEYS - set(d)), sorted(set(d) - _STEP_KEYS)
        raise ValueError(
            f"a step record has keys {', '.join(sorted(_STEP_KEYS))}: missing {missing}, unknown {unknown}"
        )
    cell = _int(d, "cell", 0, n_cells - 1)
    n = _int(d, "n_running", 1)
    kv = _int(d, "kv_tokens", n)  # every running sequence attends at least its own token
    pre = _int(d, "prefill_tokens", 0, kv)
    lat = d["latency_s"]
    if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not (0 < lat < 3600):
        raise ValueError(f"latency_s={lat!r} must be seconds in (0, 3600)")
    return Step(
        cell, CostSample(n_running=n, kv_tokens=kv, prefill_tokens=pre, latency_s=float(lat)), _bool(d, "warmup")
    )


def read_samples(path: str | Path) -> tuple[SamplesHeader, list[Step]]:
    """The header and every step of a cost-samples file; CostSamplesError (one line) at the first bad line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CostSamplesError(f"cost samples {str(p)!r} cannot be read ({type(e).__name__}: {e}); give the "
                               f"cost_samples.jsonl a device run wrote") from None  # fmt: skip
    header, steps = None, []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line, parse_constant=_refuse_constant)
            if not isinstance(d, dict):
                raise ValueError("each line must be a JSON object")
            if header is None:
                header = _header(d)
            else:
                steps.append(_step(d, len(header.cells)))
        except ValueError as e:
            why = str(e)
            raise CostSamplesError(
                f"cost samples {str(p)!r} line {i}: {why[:300]}; fix or regenerate the file (format: "
                f"staleflow/sim/cost_samples.py)"
            ) from None
    if header is None:
        raise CostSamplesError(f"cost samples {str(p)!r} is empty: it needs a header line and step lines")
    if not steps:
        raise CostSamplesError(f"cost samples {str(p)!r} has a header but no step lines: the sweep wrote nothing")
    return header, steps


class SamplesWriter:
    """Writes the header at once, then each cell's steps as one flushed write: a run stopped mid-sweep
    leaves a readable file of the cells finished so far."""

    def __init__(self, path: str | Path, header: SamplesHeader):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")
        self._f.write(header.to_json() + "\n")
        self._f.flush()
        self.steps = 0

    def write(self, steps: list[Step]) -> None:
        self._f.write("".join(s.to_json() + "\n" for s in steps))
        self._f.flush()
        self.steps += len(steps)

    def close(self) -> None:
        self._f.close()
