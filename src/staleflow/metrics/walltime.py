"""Where a run's wall time goes, and why one run reached a target accuracy later than another.

Pure functions over a run's typed records (metrics/records.py): the step rows and evaluation rows of
metrics.jsonl, and (when the run folder has it) the spans of timeline.jsonl.

    b = breakdown(steps, evals, spans)        # {"wall_s", "trainer_busy_s", "trainer_wait_s", "step_gap_cv", ...}
    x = explain_gap(steps_a, va, steps_b, vb)  # run B's extra seconds to version vb vs A's to va, split

The trainer's side is exact from metrics.jsonl alone: each step row holds the trainer's compute
(``train_s``) and weight push (``push_s``) seconds and the tokens it trained; everything else up to a
step's time is the trainer waiting for a batch (start-up and the first rollouts included). The
rollout side (share of time each rollout instance had work, seconds spent pulling weights) needs
timeline.jsonl.

``explain_gap`` splits the difference between two times-to-target (the time of the step that made
the version which first reached the target) into three terms that add up exactly:
- ``tokens_s``: B trained more (or fewer) tokens to get there, priced at A's trainer seconds per
  token: more steps, or longer responses. This is the method (what its data needed).
- ``rate_s``: the trainer took longer per token in B. The trainer does the same computation per
  token in both arms, so this is the machine: cores shared with rollout ranks that run beside the
  trainer (an asynchronous run on two shared CPU cores) or other load. On separate GPUs it vanishes.
- ``wait_s``: the trainer waited longer (or less) for batches: rollout throughput and scheduling,
  itself slowed by the same shared cores in an asynchronous run on one CPU.
"""

from __future__ import annotations


def _step_cost(r: dict) -> float:
    return float(r.get("train_s", 0.0)) + float(r.get("push_s", 0.0))


def upto(steps: list[dict], version: int) -> dict:
    """The trainer's account up to the step that made ``version`` (steps 0..version-1 trained):
    seconds elapsed, busy (compute and push), waiting, tokens trained, steps."""
    done = [r for r in steps if r["step"] < version]
    t = done[-1]["time"] if done else 0.0
    busy = sum(_step_cost(r) for r in done)
    return {
        "t_s": t,
        "busy_s": busy,
        "wait_s": t - busy,
        "tokens": sum(int(r.get("trained_tokens", 0)) for r in done),
        "steps": len(done),
    }


def explain_gap(steps_a: list[dict], version_a: int, steps_b: list[dict], version_b: int) -> dict:
    """B's time to ``version_b`` minus A's to ``version_a``, as tokens_s + rate_s + wait_s (exactly)."""
    a, b = upto(steps_a, version_a), upto(steps_b, version_b)
    rate_a = a["busy_s"] / a["tokens"] if a["tokens"] else 0.0
    rate_b = b["busy_s"] / b["tokens"] if b["tokens"] else 0.0
    tokens_s = (b["tokens"] - a["tokens"]) * rate_a
    rate_s = b["tokens"] * (rate_b - rate_a)
    # a run with no trained tokens has no rate: its busy seconds all count as the rate term
    if not a["tokens"] or not b["tokens"]:
        tokens_s, rate_s = 0.0, b["busy_s"] - a["busy_s"]
    return {
        "gap_s": b["t_s"] - a["t_s"],
        "tokens_s": tokens_s,
        "rate_s": rate_s,
        "wait_s": b["wait_s"] - a["wait_s"],
        "steps": (a["steps"], b["steps"]),
        "ms_per_token": (1000 * rate_a, 1000 * rate_b),
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for t0, t1 in sorted(intervals):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


GAP_SKIP_STEPS = 2
"""Steps left out of the step rhythm: start-up (model load, the first rollouts) sets their times."""


def step_gap_cv(steps: list[dict], evals: list[dict] = ()) -> float | None:
    """Coefficient of variation (sd / mean) of the seconds between consecutive steps from step GAP_SKIP_STEPS on:
    0 for a trainer that steps like a clock, larger when steps come in bursts (several buffers ready at once after
    a long wait). A gap that overlaps a held-out evaluation ([time - eval_s, time] of an evaluation row) is left
    out: the evaluation decodes beside the rollout, and a synchronous run waits for it where an asynchronous one
    overlaps it (an evaluation row without eval_s leaves out nothing). Leaving gaps out drops long ones more
    often and leaves fewer, so breakdown() also reports the value over every gap (``step_gap_cv_all``). None with
    fewer than 3 gaps left."""
    busy = [(float(e["time"]) - float(e["eval_s"]), float(e["time"])) for e in evals if e.get("eval_s") and "time" in e]
    times = [r["time"] for r in sorted(steps, key=lambda r: r["step"]) if r["step"] >= GAP_SKIP_STEPS]
    gaps = [b - a for a, b in zip(times, times[1:]) if not any(e0 < b and a < e1 for e0, e1 in busy)]
    if len(gaps) < 3:
        return None
    mean = sum(gaps) / len(gaps)
    if mean <= 0:
        return None
    sd = (sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1)) ** 0.5
    return sd / mean


def breakdown(steps: list[dict], evals: list[dict], spans: list[dict] | None = None) -> dict:
    """The run's wall time to its last step, split: trainer busy (compute, push), trainer waiting,
    held-out evaluation (decoded beside the rollout), and with spans the rollout's busy share and
    pull seconds. Keys with no data are absent."""
    if not steps:
        return {}
    last = max(r["step"] for r in steps)
    acct = upto(steps, last + 1)
    wall = acct["t_s"]
    out = {
        "wall_s": wall,
        "trainer_busy_s": acct["busy_s"],
        "trainer_wait_s": acct["wait_s"],
        "trainer_busy_share": acct["busy_s"] / wall if wall > 0 else None,
        "push_s": sum(float(r.get("push_s", 0.0)) for r in steps),
        "eval_s": sum(float(e.get("eval_s", 0.0)) for e in evals),
    }
    if acct["tokens"]:
        out["trainer_ms_per_token"] = 1000 * acct["busy_s"] / acct["tokens"]
    for key, skip in (("step_gap_cv", evals), ("step_gap_cv_all", [])):  # and with every gap: the sensitivity
        cv = step_gap_cv(steps, skip)
        if cv is not None:
            out[key] = cv
    if spans:
        gen: dict[int, list[tuple[float, float]]] = {}
        pulls: list[float] = []
        for s in spans:
            t0, t1 = max(0.0, s["t0"]), min(wall, s["t1"])
            if s["kind"] == "generate" and t1 > t0:
                gen.setdefault(s["rank"], []).append((t0, t1))
            elif s["kind"] == "pull":
                pulls.append(s["t1"] - s["t0"])
        if gen and wall > 0:
            out["rollout_busy_share"] = sum(_union(v) for v in gen.values()) / (len(gen) * wall)
        out["pull_s"] = sum(pulls)
    return out


def first_reached(evals: list[dict], target: float) -> int | None:
    """The first evaluated version (an evaluation row's step) whose held-out accuracy reached the target."""
    return next((e["step"] for e in evals if e["eval_accuracy"] >= target - 1e-12), None)


def explain_pairs(pairs: list[tuple[dict, dict]], target: float) -> list[dict]:
    """Per pair of runs (compare.load_run's dicts, paired by seed) where both reached the target:
    the seed, the versions that reached it and explain_gap's split of B's extra seconds."""
    out = []
    for ra, rb in pairs:
        va, vb = first_reached(ra["evals"], target), first_reached(rb["evals"], target)
        if va is None or vb is None:
            continue
        out.append({"seed": ra["seed"], "versions": (va, vb), **explain_gap(ra["steps"], va, rb["steps"], vb)})
    return out
