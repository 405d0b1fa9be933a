"""What ``staleflow sim --grid paper`` computes from its runs: per-setting rows, the summary, the sweep, the plot
(sim/grid_tables.py prints them).

Per setting and eta (sim/grid.py runs them): StaleFlow's tokens/s (mean over the grid's seeds), with
equal transfer costs, with one token per step and with the peers' redundancy; each system's mean step over its
physical floor (sim/floor.py; StaleFlow's over its one-token runs, which the floor bounds) with the rollout
utilisation at the floor and the binding term, and the critical response's slowdown over its decode alone; the
strongest fair peer and the guarantee-matched best of today's peers (sim/search.py: the fastest configuration
whose observed worst-case staleness is <= eta, among every peer or among verl and AReaL); the peers at the same
nominal eta with their fraction of trained groups beyond eta and their mean staleness; the strict peers (groups
beyond eta dropped and regenerated: they train what finishes in time, shorter responses); verl-sync.
"""

from __future__ import annotations

import os
from collections import Counter

from staleflow.modes import mode_of
from staleflow.sim import search
from staleflow.sim.floor import THROUGHPUT_BOUND
from staleflow.sim.simulator import SimResult

NEW_PEERS = ("pipelinerl",)
"""Peers (Mode.peer) added by issue 49 (2026-12-07): today's guarantee-matched column keeps to the others."""


def today(c) -> bool:
    """A PeerConfig of today's columns' peers (every peer but those added with the strongest fair peer)."""
    return mode_of(c.mode).peer not in NEW_PEERS


def family(label: str) -> str:
    """A winning configuration's family: its mode, and T>1 for verl's trigger_parameter_sync_step above 1."""
    return label.split(" ")[0] + (" T>1" if " T=" in label else "")


def floor_of(runs) -> dict:
    """Mean over runs (seeds) of each physical-floor term (sim/floor.py), the floor's utilisation, the term
    that binds most often, and the mean step over the floor."""
    runs = [r for r in runs if r.floor is not None]
    if not runs:
        return {"floor_s": 0.0, "util": 0.0, "binds": None, "step_over_floor": None}
    fl = [r.floor for r in runs]
    return {
        "train_s": round(_mean(f.train for f in fl), 1),
        "work_s": round(_mean(f.work for f in fl), 1),
        "tail_s": round(_mean(f.tail for f in fl), 1),
        "floor_s": round(_mean(f.floor for f in fl), 1),
        "util": round(_mean(f.util for f in fl), 3),
        "binds": Counter(f.binds for f in fl).most_common(1)[0][0],
        "step_over_floor": round(_mean(r.step_s / r.floor.floor for r in runs), 3),
    }


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / max(1, len(xs))


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def setting_rows(st, etas, seeds) -> list[dict]:
    """One row per eta of a finished grid.Setting."""
    cfg, rows = st.cfg, []
    sync = next((st.measured.get(c) for c in st.peers.sync()), None)
    for eta in etas:
        sf = [st.staleflow[(eta, s)] for s in seeds]
        eq = [st.equal[(eta, s)] for s in seeds]
        one = [st.one_token[(eta, s)] for s in seeds]  # one token per step: the floor bounds these
        fair = [st.staleflow_fair(eta, s) for s in seeds]
        sf_tok, eq_tok = _mean(r.tokens_per_s for r in sf), _mean(r.tokens_per_s for r in eq)
        fair_tok = _mean(r.tokens_per_s for r in fair)
        step = _mean(r.step_s for r in sf)
        fl = floor_of(one)
        g = search.best(st.measured, eta, seeds, keep=today)
        top = search.best(st.measured, eta, seeds)
        nominal = {}
        for c in st.peers.nominal(eta):
            m = st.measured[c]
            nominal[c.label] = {
                "tok_s": round(m.tok_s, 1),
                "over_eta_frac": round(m.over(eta), 3),
                "mean_staleness": round(m.mean_staleness, 2),
                "worst": m.worst,
            }
        nom_best = max(nominal, key=lambda k: nominal[k]["tok_s"])
        nom_floor = floor_of(next(m for c, m in st.measured.items() if c.label == nom_best).runs.values())
        strict = {c.label: st.strict[c] for c in st.peers.strict(eta)}
        strict_best = max(strict, key=lambda k: strict[k].tokens_per_s)
        sb = strict[strict_best]
        rows.append(
            {
                "setting": st.name,
                "model": st.model,
                "dist": st.dist,
                "split": f"{st.split[0]}:{st.split[1]}",
                "eta": eta,
                "staleflow": round(sf_tok, 1),
                "staleflow_equal_transfer": round(eq_tok, 1),
                "step_s": round(step, 1),
                "floor_s": fl["floor_s"],
                "step_over_floor": fl["step_over_floor"],
                "step_over_floor_spec": floor_of(sf)["step_over_floor"],
                "staleflow_one_token": round(_mean(r.tokens_per_s for r in one), 1),
                "critical_slowdown": round(_mean(r.critical_slowdown for r in one), 3),
                "critical_slowdown_spec": round(_mean(r.critical_slowdown for r in sf), 3),
                "critical_slowdown_lanes": round(_mean(st.lanes[(eta, s)].critical_slowdown for s in seeds), 3),
                "step_over_floor_lanes": floor_of([st.lanes[(eta, s)] for s in seeds])["step_over_floor"],
                "lanes_per_step": round(_mean(st.lanes[(eta, s)].lanes for s in seeds) / cfg.steps, 2),
                "spec_frac": round(_mean(r.spec_frac for r in sf), 3),
                "staleflow_fair": round(fair_tok, 1),
                "strongest_fair": top.cfg.label if top else None,
                "strongest_fair_tok_s": round(top.tok_s, 1) if top else None,
                "strongest_fair_worst": top.worst if top else None,
                "vs_strongest_fair": _ratio(fair_tok, top.tok_s) if top else None,
                "step_over_floor_strongest_fair": floor_of(top.runs.values())["step_over_floor"] if top else None,
                "critical_slowdown_strongest_fair": (
                    round(_mean(r.critical_slowdown for r in top.runs.values()), 3) if top else None
                ),
                "floor": fl,
                "util": fl["util"],
                "binds": fl["binds"],
                "regime": "throughput" if fl["util"] >= THROUGHPUT_BOUND else "tail",
                "responses_per_instance": round(
                    st.B * cfg.staleness.group_capacity / max(1, cfg.rollout_gpus // cfg.gpus_per_instance), 1
                ),
                "preemptions_per_step": round(_mean(r.preemptions for r in sf) / cfg.steps, 1),
                "step_over_floor_equal_transfer": floor_of(eq)["step_over_floor"],
                "step_over_floor_guarantee_best": floor_of(g.runs.values())["step_over_floor"] if g else None,
                "step_over_floor_nominal_best": nom_floor["step_over_floor"],
                "guarantee_best": g.cfg.label if g else None,
                "guarantee_best_tok_s": round(g.tok_s, 1) if g else None,
                "guarantee_best_worst": g.worst if g else None,
                "guarantee_best_mean_staleness": round(g.mean_staleness, 2) if g else None,
                "vs_guarantee_best": _ratio(sf_tok, g.tok_s) if g else None,
                "vs_guarantee_best_equal_transfer": _ratio(eq_tok, g.tok_s) if g else None,
                "nominal": nominal,
                "nominal_best": nom_best,
                "vs_nominal_best": _ratio(sf_tok, nominal[nom_best]["tok_s"]),
                "strict": {k: round(r.tokens_per_s, 1) for k, r in strict.items()},
                "strict_best": strict_best,
                "vs_strict_best": _ratio(sf[0].tokens_per_s, sb.tokens_per_s),
                "strict_dropped_frac": round(
                    sb.aborts.get("window-closed", 0) / max(1, sb.fates.get("consumed", 0)), 3
                ),
                "strict_mean_len": round(sb.tokens / max(1, sb.samples), 0),
                "staleflow_mean_len": round(_mean(r.tokens / max(1, r.samples) for r in sf), 0),
                "vs_sync": _ratio(sf_tok, sync.tok_s) if sync else None,
                "capped_batches": round(
                    _mean(
                        sum(n >= cfg.max_response for n in r.longest[cfg.warmup_steps :])
                        / max(1, len(r.longest[cfg.warmup_steps :]))
                        for r in sf
                    ),
                    3,
                ),
            }
        )
        if any(r.tool_calls for r in sf):  # a multi-turn setting: the tool time in each system's tail
            peer = list(g.runs.values()) if g else []
            rows[-1]["tools"] = {
                "tool_s_mean": round(_mean(r.tool_s_mean for r in sf), 2),
                "staleflow_wall_p50": round(_mean(r.wall_p50 for r in sf), 1),
                "staleflow_wall_p99": round(_mean(r.wall_p99 for r in sf), 1),
                "guarantee_best_wall_p99": round(_mean(r.wall_p99 for r in peer), 1) if peer else None,
                "staleflow_parked_interrupted": round(_mean(_cut(r) for r in sf), 1),
                "staleflow_parked_aborted": round(_mean(r.parked_taken.get("abort", 0) for r in sf), 1),
                "guarantee_best_parked_interrupted": round(_mean(_cut(r) for r in peer), 1) if peer else None,
            }
    return rows


def _cut(r) -> int:
    """Trajectories a run interrupted while they waited on a tool (each re-runs its call where it resumes)."""
    return sum(n for reason, n in r.parked_taken.items() if reason not in ("abort", "truncate"))


def search_rows(st) -> list[dict]:
    """Every searched peer configuration of a setting (seeds run, tokens/s, worst and mean staleness)."""
    return [
        {
            "config": m.cfg.label,
            "seeds": sorted(m.runs),
            "tok_s": round(m.tok_s, 1),
            "worst": m.worst,
            "mean_staleness": round(m.mean_staleness, 2),
        }
        for m in st.measured.values()
    ]


def ablation_ratios(abl: dict, seeds) -> dict:
    """Ablated / full StaleFlow tokens/s at the centre, each the ratio of the means over `seeds`."""
    full = _mean(abl[("full", s)].tokens_per_s for s in seeds)
    names = dict.fromkeys(k for k, _ in abl if k != "full")
    return {k: round(_mean(abl[(k, s)].tokens_per_s for s in seeds) / full, 3) for k in names}


def sweep_rows(swept: dict, seeds, centre=None) -> list[dict]:
    """The acceptance sweep (grid.run_grid's ``swept``: (system, accept, seed) -> SimResult) as rows by accept:
    StaleFlow (the peers' redundancy) and the centre's strongest fair peer, tokens/s (mean over seeds) and their
    ratio; ``centre`` (setting, eta): its runs at the default acceptance join as one more row."""
    by: dict = {}
    for (system, accept, _seed), r in swept.items():
        by.setdefault(accept, {}).setdefault(system, []).append(r)
    if centre is not None:
        st, eta = centre
        top = search.best(st.measured, eta, seeds)
        default = st.cfg.spec_accept
        by.setdefault(default, {})["staleflow"] = [st.staleflow_fair(eta, s) for s in seeds]
        if top is not None:
            by[default][top.cfg.label] = list(top.runs.values())
    rows = []
    for accept in sorted(by):
        runs = by[accept]
        sf = _mean(r.tokens_per_s for r in runs.get("staleflow", []))
        peer = next((k for k in runs if k != "staleflow"), None)
        ptok = _mean(r.tokens_per_s for r in runs[peer]) if peer else 0.0
        rows.append(
            {
                "accept": accept,
                "staleflow": round(sf, 1),
                "peer": peer,
                "peer_tok_s": round(ptok, 1),
                "vs_peer": _ratio(sf, ptok),
                "staleflow_spec_frac": round(_mean(r.spec_frac for r in runs.get("staleflow", [])), 3),
            }
        )
    return rows


def summary(rows: list[dict], every: list[SimResult], ablation: dict) -> dict:
    def stats(key):
        xs = [r[key] for r in rows if r[key] is not None]
        return round(_mean(xs), 3), max(xs, default=0.0)

    def within(regime, key):
        xs = [r[key] for r in rows if r["regime"] == regime and r[key] is not None]
        return (round(_mean(xs), 3) if xs else None), (max(xs) if xs else None)

    g_avg, g_max = stats("vs_guarantee_best")
    tp_avg, tp_max = within("throughput", "vs_guarantee_best")
    tail_avg, tail_max = within("tail", "vs_guarantee_best")
    sof = [r["step_over_floor"] for r in rows if r["step_over_floor"] is not None]
    n_avg, n_max = stats("vs_nominal_best")
    s_avg, s_max = stats("vs_sync")
    families = Counter(family(r["guarantee_best"]) for r in rows if r["guarantee_best"])
    strongest = Counter(family(r["strongest_fair"]) for r in rows if r["strongest_fair"])
    fair_avg, fair_max = within("throughput", "vs_strongest_fair")
    tp_sof = [r["step_over_floor"] for r in rows if r["regime"] == "throughput" and r["step_over_floor"] is not None]
    crit = [r["critical_slowdown"] for r in rows if r["regime"] == "throughput" and r["critical_slowdown"]]
    crit_lanes = [r["critical_slowdown_lanes"] for r in rows if r["regime"] == "throughput"]
    return {
        "vs_strongest_fair_avg_throughput_bound": fair_avg,
        "vs_strongest_fair_max_throughput_bound": fair_max,
        "strongest_fair_peer": strongest.most_common(1)[0][0] if strongest else None,
        "vs_strongest_fair_avg": stats("vs_strongest_fair")[0],
        "step_over_physical_floor_max_throughput_bound": max(tp_sof, default=None),
        "critical_slowdown_max": max(crit, default=None),
        "critical_slowdown_max_lanes": max(crit_lanes, default=None),
        "vs_guarantee_best_avg_throughput_bound": tp_avg,
        "vs_guarantee_best_max_throughput_bound": tp_max,
        "throughput_bound_rows": sum(r["regime"] == "throughput" for r in rows),
        "vs_guarantee_best_avg_tail_bound": tail_avg,
        "vs_guarantee_best_max_tail_bound": tail_max,
        "step_over_physical_floor_max": max(sof, default=None),
        "step_over_physical_floor_avg": round(_mean(sof), 3),
        "rows": len(rows),
        "vs_guarantee_best_avg": g_avg,
        "vs_guarantee_best_max": g_max,
        "vs_guarantee_best_equal_transfer_avg": stats("vs_guarantee_best_equal_transfer")[0],
        "vs_nominal_best_avg": n_avg,
        "vs_nominal_best_max": n_max,
        "vs_strict_best_avg": stats("vs_strict_best")[0],
        "vs_sync_max": s_max,
        "vs_sync_avg": s_avg,
        "guarantee_best": families.most_common(1)[0][0] if families else None,
        "ablation": ablation,
        "violations": sum(len(r.violations) for r in every),
    }


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(20, 7), sharey=True)
    labels = [f"{r['setting']} eta={r['eta']}" for r in rows]
    for ax, key, title in (
        (axes[0], "vs_guarantee_best", "over the guarantee-matched best peer"),
        (axes[1], "vs_guarantee_best_equal_transfer", "same, equal transfer costs"),
        (axes[2], "vs_nominal_best", "over the best peer at nominal eta"),
    ):
        vals = [r[key] or 0.0 for r in rows]
        ax.barh(labels[::-1], vals[::-1], color=["tab:blue" if v >= 1 else "tab:red" for v in vals][::-1])
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(f"staleflow {title}")
        ax.set_xlabel("trained tokens/s ratio")
    fig.suptitle("staleflow sim --grid paper (128 H20-class GPUs)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
