"""``staleflow sim --grid paper``: the evaluation grid, StaleFlow against peers held to the same guarantee.

The settings, seeds and column changes are sim/grid_settings.py's. Every row reports each system's mean step
over its physical floor (sim/floor.py), the rollout utilisation at the floor and the binding term (>= 0.5:
throughput-bound). ``--grid-settings`` runs a subset, ``--smoke`` the authors' shapes only.

The headline (per setting and eta, since 2026-12-07): StaleFlow over the STRONGEST FAIR PEER, the fastest peer
configuration whose OBSERVED worst-case staleness is <= eta among every registered peer (sim/search.py: verl
fully-async's staleness_threshold and trigger_parameter_sync_step and its partial_rollout=False mode, AReaL's
max_head_offpolicyness and concurrency cap, PipelineRL's lag and PipelineRL held to the bound by reservation,
verl-sync, verl-one-step-off; worst case over every trained group of ``SEEDS``), every system with the engine
mechanisms its engine could use (the same weight-transfer bandwidth into an instance, speculative decoding,
KV kept across an update where its code keeps it) and StaleFlow with the peers' redundancy (none). Beside it,
today's columns: the guarantee-matched best of verl and AReaL (StaleFlow with its own redundancy), the peers at
the same NOMINAL eta (with their fraction of groups beyond eta and mean staleness), the STRICT variants that
drop and regenerate over-stale groups (seed 0 only), and EQUAL TRANSFER (StaleFlow's push and pulls at the
peers' broadcast bandwidth, the push holding the trainer). StaleFlow also runs with ONE TOKEN per step (no
speculative decoding): the physical floor bounds those runs' step, and their critical response's slowdown is
reported, beside the same runs with tail lanes (the slowdown after the lanes). StaleFlow runs on every seed of ``SEEDS``; ratios are of seed means. Ablations (report.ABLATIONS) run
at the paper-like ``CENTRE`` over ``ABLATION_SEEDS``, and a sweep over the speculative acceptance there
(StaleFlow and the centre's strongest fair peer). Every run is one task of a process pool (``--jobs``); the
search's later seeds are submitted as its first results come in. Ends with the JSON line of grid_report.summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from functools import partial

from staleflow.config import ConfigError
from staleflow.sim import grid_report as rep
from staleflow.sim import grid_tables as tab
from staleflow.sim import search
from staleflow.sim.config import SimConfig
from staleflow.sim.grid_settings import (  # noqa: F401  (the grid's names, re-exported)
    ABLATION_SEEDS,
    CENTRE,
    ETAS,
    EXTRA,
    LANES,
    ONE_TOKEN,
    SEEDS,
    SMOKE,
    SPEC_SWEEP,
    Shape,
    _matches,
    equal_transfer,
    fair,
    grid_base,
    setting_cfg,
    settings,
)
from staleflow.sim.report import ABLATIONS
from staleflow.sim.simulator import SimResult, run


def run_task(
    cfg: SimConfig, mode: str, eta: int, overrides: dict, peer: dict, changes: dict, seed: int, label: str
) -> SimResult:
    """One simulated run (a process-pool task)."""
    cfg = dataclasses.replace(cfg, seed=seed, **changes)
    return run(cfg, mode, eta, overrides, f"{label} seed={seed}", peer=peer)


class Setting:
    """Every run of one setting: the peer search, StaleFlow (as it is, with equal transfer, with one token per
    step, with the peers' redundancy), the strict peers."""

    def __init__(self, base: SimConfig, shape: Shape):
        self.shape = shape
        self.name, self.model, self.dist, self.split = shape.name, shape.model, shape.dist, shape.split
        self.cfg = setting_cfg(base, shape)
        self.B = self.cfg.staleness.batch_size
        self.etas = shape.etas or ETAS
        self.peers = search.PeerSet(self.cfg.modes, self.B)
        """The peers among --modes: their families, nominal, strict and synchronous configurations."""
        self.measured: dict = {}  # PeerConfig -> search.Measured
        self.staleflow: dict = {}  # (eta, seed) -> SimResult
        self.equal: dict = {}  # (eta, seed) -> SimResult
        self.one_token: dict = {}  # (eta, seed) -> SimResult: no speculative decoding (the floor's runs)
        self.lanes: dict = {}  # (eta, seed) -> SimResult: the same with tail lanes
        self.fair_changes = fair(self.cfg)
        self.fair: dict = {}  # (eta, seed) -> SimResult: the peers' redundancy (only where it differs)
        self.strict: dict = {}  # PeerConfig -> SimResult (seed 0)
        self.scans_left = 0
        self.pending: set = set()  # (PeerConfig, seed) submitted and not back yet

    def families(self) -> list:
        return self.peers.families(max(self.etas) if self.shape.search == "reduced" else None)

    def record(self, cfg, seed, r) -> None:
        self.measured.setdefault(cfg, search.Measured(cfg)).runs[seed] = r
        self.pending.discard((cfg, seed))

    def results(self) -> list[SimResult]:
        return (
            [r for m in self.measured.values() for r in m.runs.values()]
            + list(self.staleflow.values())
            + list(self.equal.values())
            + list(self.one_token.values())
            + list(self.lanes.values())
            + list(self.fair.values())
            + list(self.strict.values())
        )

    def staleflow_fair(self, eta: int, seed: int) -> SimResult:
        """StaleFlow with the peers' redundancy (its own runs where it has none)."""
        return (self.fair if self.fair_changes else self.staleflow)[(eta, seed)]

    def complete(self) -> bool:
        n = len(self.etas) * len(SEEDS)
        return (
            self.scans_left == 0
            and not self.pending
            and len(self.staleflow) == len(self.equal) == len(self.one_token) == len(self.lanes) == n
            and len(self.fair) == (n if self.fair_changes else 0)
            and len(self.strict) == sum(len(self.peers.strict(eta)) for eta in self.etas)
        )


def _scan(cfg: SimConfig, family: list, seed: int, max_eta: int):
    """A search family on one seed, in order, until its worst case passes max_eta (a pool task)."""

    def one(c, s):
        mode, eta, ov, peer = c.args()
        return run_task(cfg, mode, eta, ov, peer, {}, s, c.label)

    return search.scan(family, one, seed, max_eta)


def run_grid(
    base: SimConfig, jobs: int = 1, progress=print, shapes=None, centre=None, ablation_seeds=None, sweep=True
) -> tuple[list[Setting], dict, list[SimResult], dict]:
    """(settings with all their runs, ablation ratios at the centre, the ablation runs, the acceptance sweep at the
    centre: (system label, accept, seed) -> SimResult)."""
    sets = [Setting(base, sh) for sh in (shapes if shapes is not None else settings())]
    centre_name, centre_eta = centre or CENTRE
    abl_seeds = ABLATION_SEEDS if ablation_seeds is None else ablation_seeds
    centre_set = next(s for s in sets if s.name == centre_name)
    futures: dict = {}  # future -> handler(result)
    abl: dict = {}  # (label, seed) -> SimResult
    swept: dict = {}  # (system, accept, seed) -> SimResult
    done_settings: set = set()
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:

        def submit(fn, handler, *args):
            futures[pool.submit(fn, *args)] = handler

        def one(st: Setting, handler, mode, eta, ov, peer, changes, seed, label):
            submit(run_task, handler, st.cfg, mode, eta, ov, peer, changes, seed, label)

        def peer_run(st: Setting, c, seed):
            st.pending.add((c, seed))
            mode, eta, ov, peer = c.args()
            one(st, lambda r, st=st, c=c, seed=seed: st.record(c, seed, r), mode, eta, ov, peer, {}, seed, c.label)

        def sweep_runs(st: Setting):
            """The acceptance sweep at the centre: StaleFlow (the peers' redundancy) and the strongest fair peer."""
            top = search.best(st.measured, centre_eta, SEEDS)
            for accept in SPEC_SWEEP:
                for seed in SEEDS:
                    k = ("staleflow", accept, seed)
                    ch = {**st.fair_changes, "spec_accept": accept}
                    label = f"staleflow eta={centre_eta} accept={accept}"
                    one(st, lambda r, k=k: swept.__setitem__(k, r), "staleflow", centre_eta, {}, {}, ch, seed, label)
                    if top is not None:
                        mode, e, ov, peer = top.cfg.args()
                        k, ch = (top.cfg.label, accept, seed), {"spec_accept": accept}
                        label = f"{top.cfg.label} accept={accept}"
                        one(st, lambda r, k=k: swept.__setitem__(k, r), mode, e, ov, peer, ch, seed, label)

        # Longest chains first: the families of the slowest settings (most responses, then 32B), then single runs.
        def heavy(st: Setting):
            return (-st.B * st.cfg.staleness.group_size, st.model != "32B")

        for st in sorted(sets, key=heavy):
            fams = st.families()
            st.scans_left = len(fams)
            for fam in fams:

                def scanned(out, st=st):
                    for c, r in out:
                        st.record(c, SEEDS[0], r)
                    st.scans_left -= 1

                submit(_scan, scanned, st.cfg, fam, SEEDS[0], max(st.etas))
        for st in sorted(sets, key=heavy):
            for eta in st.etas:
                for seed in SEEDS:
                    k = (eta, seed)
                    one(
                        st,
                        lambda r, st=st, k=k: st.staleflow.__setitem__(k, r),
                        "staleflow",
                        eta,
                        {},
                        {},
                        {},
                        seed,
                        f"staleflow eta={eta}",
                    )
                    for runs, changes, what in (
                        (st.equal, equal_transfer(st.cfg), " equal-transfer"),
                        (st.one_token, ONE_TOKEN, " one-token"),
                        (st.fair, st.fair_changes, " no-redundancy"),
                    ):
                        if changes:
                            label = f"staleflow eta={eta}{what}"
                            one(st, partial(runs.__setitem__, k), "staleflow", eta, {}, {}, changes, seed, label)
                    label = f"staleflow eta={eta} one-token lanes"  # the critical slowdown with the lanes
                    one(st, partial(st.lanes.__setitem__, k), "staleflow", eta, LANES, {}, ONE_TOKEN, seed, label)
                for c in st.peers.strict(eta):
                    mode, e, ov, peer = c.args()
                    one(st, lambda r, st=st, c=c: st.strict.__setitem__(c, r), mode, e, ov, peer, {}, SEEDS[0], c.label)
        for seed in abl_seeds:
            for name, mode, ov, changes in [("full", "staleflow", {}, {})] + list(ABLATIONS):
                one(
                    centre_set,
                    lambda r, k=(name, seed): abl.__setitem__(k, r),
                    mode,
                    centre_eta,
                    ov,
                    {},
                    changes,
                    seed,
                    f"staleflow eta={centre_eta} {name}",
                )
        while futures:
            finished, _ = wait(list(futures), return_when=FIRST_COMPLETED)
            for f in finished:
                futures.pop(f)(f.result())
            for st in sets:
                if st.scans_left == 0 and not st.pending:  # after the scans: nominal peers, later seeds as needed
                    forced = [c for eta in st.etas for c in st.peers.nominal(eta)] + st.peers.sync()
                    todo = [
                        (c, seed)
                        for c in forced
                        for seed in SEEDS
                        if seed not in st.measured.get(c, search.Measured(c)).runs
                    ]
                    todo += search.more_seeds(st.measured, st.etas, SEEDS, keeps=(None, rep.today))
                    for c, seed in dict.fromkeys(todo):
                        peer_run(st, c, seed)
                if st.name not in done_settings and st.complete():
                    done_settings.add(st.name)
                    progress(tab.setting_text(st, st.etas, SEEDS))
                    if st is centre_set and sweep:
                        sweep_runs(st)
    ablation = rep.ablation_ratios(abl, abl_seeds) if abl_seeds else {}
    return sets, ablation, list(abl.values()), swept


def main(base: SimConfig) -> int:
    t0 = time.perf_counter()
    base = grid_base(base)
    jobs = base.jobs or os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    pick = [p.strip() for p in base.grid_settings.split(",") if p.strip()]
    shapes = [
        sh
        for sh in settings()
        if (not base.smoke or sh.name in SMOKE) and (not pick or any(_matches(p, sh.name) for p in pick))
    ]
    search.PeerSet(base.modes, 1).check()
    if not shapes:
        raise ConfigError(
            f"--grid-settings={base.grid_settings!r} matches no setting; names: "
            f"{', '.join(sh.name for sh in settings())}"
        )
    centre = CENTRE if any(sh.name == CENTRE[0] for sh in shapes) else (shapes[0].name, max(shapes[0].etas or ETAS))
    abl_seeds = () if not base.ablation else ABLATION_SEEDS[:1] if base.smoke else ABLATION_SEEDS  # --no-ablation
    n_rows = sum(len(sh.etas or ETAS) for sh in shapes)
    print(
        f"staleflow sim --grid paper{' --smoke' if base.smoke else ''}: {len(shapes)} settings, {n_rows} rows "
        f"({', '.join(sh.name for sh in shapes)}; eta {list(ETAS)} unless noted); StaleFlow against the fastest "
        f"peer configuration with observed worst-case staleness <= eta (seeds {list(SEEDS)}: the strongest fair "
        f"peer, and the best of verl and AReaL), the peers at nominal eta, the strict peers, equal transfer and one "
        f"token per step; every run's physical floor; ablations at {centre} over seeds "
        f"{list(abl_seeds)}; {base.steps} steps per run, first {base.warmup_steps} not measured; {jobs} processes; "
        f"load average {load:.1f}",
        flush=True,
    )

    def progress(text):
        print(f"\n{text}\n({time.perf_counter() - t0:.0f} s)", flush=True)

    sets, ablation, abl_runs, swept = run_grid(base, jobs, progress, shapes, centre, abl_seeds, sweep=base.ablation)
    rows = [row for st in sets for row in rep.setting_rows(st, st.etas, SEEDS)]
    print(
        "\nSummary: StaleFlow at eta over the guarantee-matched best peer (observed worst case <= eta), over "
        "the same best peer with equal transfer costs, over the best peer at the same nominal eta, over the "
        "strict peers, and over verl-sync; util = rollout utilisation at the physical floor (>= 0.5: "
        "throughput-bound), binds = the floor's largest term, st/fl = each system's mean step over its own floor"
    )
    print(tab.summary_table(rows))
    print(
        f"\nAblation at the paper-like centre {centre} (ablated / full staleflow tokens/s, ratio of the means over "
        f"seeds {list(abl_seeds)}): " + ", ".join(f"{k} {v}" for k, v in ablation.items())
    )
    centre_set = next((st for st in sets if st.name == centre[0]), None)
    spec = rep.sweep_rows(swept, SEEDS, (centre_set, centre[1])) if swept else []
    if spec:
        print(f"\nSpeculative acceptance at the centre {centre} (tokens per verify forward; seeds {list(SEEDS)}):")
        print(tab.sweep_table(spec))
    every = [r for st in sets for r in st.results()] + abl_runs + list(swept.values())
    out = rep.summary(rows, every, ablation)
    wall = time.perf_counter() - t0
    out_dir = base.out_dir or "runs/sim-grid"
    rep.plot(rows, os.path.join(out_dir, "grid.png"))
    with open(os.path.join(out_dir, "grid.json"), "w") as f:
        json.dump(
            {
                "summary": out,
                "settings": rows,
                "search": {st.name: rep.search_rows(st) for st in sets},
                "spec_sweep": spec,
                "wall_s": round(wall, 1),
                "jobs": jobs,
                "runs": [r.row() for r in every],
            },
            f,
            indent=1,
            default=str,
        )
    end_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"\nwrote {os.path.join(out_dir, 'grid.png')} and {os.path.join(out_dir, 'grid.json')}; {len(every)} runs "
        f"in {wall:.0f} s with {jobs} processes (load average {load:.1f} at the start, {end_load:.1f} at the end)"
    )
    for r in every:
        if r.violations:
            print(f"PROTOCOL VIOLATION or incomplete run in {r.label}: {r.violations[:3]}", file=sys.stderr)
    print(json.dumps(out))
    return 1 if out["violations"] else 0
