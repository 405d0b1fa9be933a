"""What ``staleflow sim --grid paper`` prints: a setting's search listing and per-eta table, the summary table,
the acceptance sweep (sim/grid_report.py computes the rows)."""

from __future__ import annotations

from staleflow.sim.grid_report import setting_rows


def setting_text(st, etas, seeds) -> str:
    lines = [f"== {st.name} ==", "peer search (seed-0 scans, later seeds where they can decide a winner):"]
    for m in sorted(st.measured.values(), key=lambda m: (m.cfg.mode, m.cfg.label)):
        lines.append(
            f"  {m.cfg.label:36s} seeds {','.join(map(str, sorted(m.runs))):4s} {m.tok_s:8.0f} tok/s  "
            f"worst {m.worst}  mean staleness {m.mean_staleness:.2f}"
        )
    head = (
        f"{'eta':>3s} {'util':>5s} {'binds':>5s} {'staleflow':>9s} {'step/floor':>10s}  "
        f"{'guarantee-matched best peer':34s} {'tok/s':>7s} "
        f"{'worst':>5s} {'x':>6s}  {'eq-transfer':>11s} {'x':>6s}  {'nominal best (>eta, mean st)':44s} {'x':>6s}  "
        f"{'strict best (seed 0)':30s} {'x':>6s} {'x sync':>6s}"
    )
    lines += ["", head, "-" * len(head)]
    for r in setting_rows(st, etas, seeds):
        n = r["nominal"][r["nominal_best"]]
        nom = f"{r['nominal_best']} ({n['over_eta_frac']:.0%}, {n['mean_staleness']:.2f})"
        lines.append(
            f"{r['eta']:3d} {r['util']:5.2f} {r['binds'] or '-':>5s} {r['staleflow']:9.0f} "
            f"{_f(r['step_over_floor'], '10.3f')}  {r['guarantee_best']!s:34s} "
            f"{r['guarantee_best_tok_s'] or 0:7.0f} {r['guarantee_best_worst']!s:>5s} "
            f"{r['vs_guarantee_best'] or 0:6.3f}  {r['staleflow_equal_transfer']:11.0f} "
            f"{r['vs_guarantee_best_equal_transfer'] or 0:6.3f}  {nom:44s} {r['vs_nominal_best']:6.3f}  "
            f"{r['strict_best']:30s} {r['vs_strict_best']:6.3f} {r['vs_sync'] or 0:6.3f}"
        )
    head = (
        f"{'eta':>3s} {'strongest fair peer':34s} {'tok/s':>7s} {'worst':>5s} {'staleflow':>9s} {'x fair':>6s}  "
        f"{'one-token st/fl':>15s} {'crit slow':>9s} {'lanes':>8s} {'peer st/fl':>10s} {'peer crit':>9s} {'lanes/st':>8s}"
    )
    lines += [
        "",
        "the strongest fair peer (every peer, the same engine mechanisms; StaleFlow with the peers' redundancy):",
    ]
    lines += [head, "-" * len(head)]
    for r in setting_rows(st, etas, seeds):
        lines.append(
            f"{r['eta']:3d} {r['strongest_fair']!s:34s} {r['strongest_fair_tok_s'] or 0:7.0f} "
            f"{r['strongest_fair_worst']!s:>5s} {r['staleflow_fair']:9.0f} {_f(r['vs_strongest_fair'])}  "
            f"{_f(r['step_over_floor'], '15.3f')} {_f(r['critical_slowdown'], '9.2f')} "
            f"{_f(r['critical_slowdown_lanes'], '8.2f')} "
            f"{_f(r['step_over_floor_strongest_fair'], '10.3f')} {_f(r['critical_slowdown_strongest_fair'], '9.2f')} "
            f"{r['lanes_per_step']:8.2f}"
        )
    for r in setting_rows(st, etas, seeds):
        if "tools" in r:
            t = r["tools"]
            lines.append(
                f"tools, eta {r['eta']}: {t['tool_s_mean']:.2f} s a call; trajectory wall time (first route to finish, "
                f"tool waits included) staleflow p50 {t['staleflow_wall_p50']:.0f} s, p99 "
                f"{t['staleflow_wall_p99']:.0f} s; guarantee-matched peer p99 "
                f"{t['guarantee_best_wall_p99'] or 0:.0f} s; "
                f"interrupted while waiting on a tool (a re-run call; mean over seeds) staleflow "
                f"{t['staleflow_parked_interrupted']:.0f}, peer {t['guarantee_best_parked_interrupted'] or 0:.0f}; "
                f"aborted while waiting staleflow {t['staleflow_parked_aborted']:.0f}"
            )
    return "\n".join(lines)


def _f(x, fmt="6.3f") -> str:
    return format(x, fmt) if x is not None else "-".rjust(int(fmt.split(".")[0]))


def summary_table(rows: list[dict]) -> str:
    head = (
        f"{'setting':28s} {'eta':>3s} {'resp/i':>6s} {'util':>5s} {'binds':>5s} {'staleflow':>9s} "
        f"{'strongest fair peer':30s} {'x fair':>6s} "
        f"{'guarantee-matched best':34s} {'x guar':>6s} {'x eq-tr':>7s} {'x nom':>6s} {'x strict':>8s} "
        f"{'x sync':>6s} {'step s':>7s} {'floor s':>7s} {'st/fl':>6s} {'crit':>5s} {'peer st/fl':>10s} {'pre/st':>6s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['setting']:28s} {r['eta']:3d} {r['responses_per_instance']:6.1f} {r['util']:5.2f} "
            f"{r['binds'] or '-':>5s} {r['staleflow']:9.0f} {r['strongest_fair']!s:30s} {_f(r['vs_strongest_fair'])} "
            f"{r['guarantee_best']!s:34s} "
            f"{_f(r['vs_guarantee_best'])} {_f(r['vs_guarantee_best_equal_transfer'], '7.3f')} "
            f"{r['vs_nominal_best']:6.3f} {r['vs_strict_best']:8.3f} {_f(r['vs_sync'])} "
            f"{r['step_s']:7.1f} {r['floor_s']:7.1f} {_f(r['step_over_floor'])} {_f(r['critical_slowdown'], '5.2f')} "
            f"{_f(r['step_over_floor_guarantee_best'], '10.3f')} {r['preemptions_per_step']:6.1f}"
        )
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    head = f"{'accept':>6s} {'staleflow':>9s} {'spec frac':>9s}  {'strongest fair peer':34s} {'tok/s':>8s} {'x':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['accept']:6.2f} {r['staleflow']:9.0f} {r['staleflow_spec_frac']:9.2f}  {r['peer']!s:34s} "
            f"{r['peer_tok_s']:8.0f} {_f(r['vs_peer'])}"
        )
    return "\n".join(lines)
