"""``staleflow sim --grid paper``: the evaluation grid, StaleFlow against peers held to the same guarantee.

Axes (2 x 3 x 2 x 2 = 24 settings): a 7B-class and a 32B-class cost model (PSRL's Qwen2.5-7B TP1
and Qwen2.5-32B TP2 coefficients; KV capacity, prefill/train rates and weight-transfer times derived
from the model size and an H20, sim/hardware.py), eta in {1, 2, 3}, two response-length
distributions (lognormal and long-cot, sim/lengths.py) and two rollout:train splits of 128 GPUs
(64:64 and 96:32, the splits of verl's fully-async example scripts).

The headline (per setting and eta): StaleFlow at eta against the FASTEST peer configuration whose
OBSERVED worst-case staleness is <= eta (sim/search.py: verl fully-async's staleness_threshold and
trigger_parameter_sync_step, its partial_rollout=False mode, AReaL's max_head_offpolicyness and
concurrency cap, verl-sync, verl-one-step-off; worst case over every trained group of ``SEEDS``).
Secondary columns, each labelled: the peers at the same NOMINAL eta (with their fraction of groups
beyond eta and mean staleness), the STRICT variants that drop and regenerate over-stale groups
(seed 0 only), and EQUAL TRANSFER (StaleFlow's push and pulls at the peers' broadcast bandwidth, the
push holding the trainer). StaleFlow runs on every seed of ``SEEDS``; ratios are of seed means.
Ablations (report.ABLATIONS) run at the grid centre over ``ABLATION_SEEDS``. Every run is one task
of a process pool (``--jobs``); the search's later seeds are submitted as its first results come in.
Ends with the JSON line of grid_report.summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from staleflow.coordinator.cost_model import load_cost_model
from staleflow.sim import grid_report as rep
from staleflow.sim import search
from staleflow.sim.config import SimConfig
from staleflow.sim.hardware import derive
from staleflow.sim.report import ABLATIONS
from staleflow.sim.simulator import SimResult, run

MODELS = (("7B", "qwen2.5-7b-tp1", 1), ("32B", "qwen2.5-32b-tp2", 2))
ETAS = (1, 2, 3)
DISTS = ("lognormal", "long-cot")
SPLITS = ((64, 64), (96, 32))
CENTRE = ("32B", 2, "long-cot", (64, 64))
SEEDS = search.SEEDS
ABLATION_SEEDS = (0, 1, 2)


def setting_cfg(base: SimConfig, cost_model: str, tp: int, dist: str, split: tuple[int, int]) -> SimConfig:
    return dataclasses.replace(
        base,
        cost_model=cost_model,
        gpus_per_instance=tp,
        length_dist=dist,
        total_gpus=sum(split),
        rollout_gpus=split[0],
        out_dir="",
    )


def equal_transfer(cfg: SimConfig) -> dict:
    """SimConfig changes that give StaleFlow the peers' weight-transfer cost: push and every pull at the
    broadcast bandwidth, and the push holds the trainer (as the peers' broadcast does)."""
    b = derive(cfg, load_cost_model(cfg.cost_model)).broadcast_s
    return {"push_s": b, "pull_s": b, "push_blocks_trainer": True}


def settings() -> list[tuple]:
    """(name, model, cost model, TP, length distribution, split) of every setting, grid order."""
    return [(f"{m} {d} {s[0]}:{s[1]}", m, cm, tp, d, s) for m, cm, tp in MODELS for d in DISTS for s in SPLITS]


def run_task(
    cfg: SimConfig, mode: str, eta: int, overrides: dict, peer: dict, changes: dict, seed: int, label: str
) -> SimResult:
    """One simulated run (a process-pool task)."""
    cfg = dataclasses.replace(cfg, seed=seed, **changes)
    return run(cfg, mode, eta, overrides, f"{label} seed={seed}", peer=peer)


class Setting:
    """Every run of one setting: the peer search, StaleFlow (and equal transfer), the strict peers."""

    def __init__(self, base: SimConfig, name, model, cost_model, tp, dist, split):
        self.name, self.model, self.dist, self.split = name, model, dist, split
        self.cfg = setting_cfg(base, cost_model, tp, dist, split)
        self.B = base.staleness.batch_size
        self.measured: dict = {}  # PeerConfig -> search.Measured
        self.staleflow: dict = {}  # (eta, seed) -> SimResult
        self.equal: dict = {}  # (eta, seed) -> SimResult
        self.strict: dict = {}  # PeerConfig -> SimResult (seed 0)
        self.scans_left = 0
        self.pending: set = set()  # (PeerConfig, seed) submitted and not back yet

    def record(self, cfg, seed, r) -> None:
        self.measured.setdefault(cfg, search.Measured(cfg)).runs[seed] = r
        self.pending.discard((cfg, seed))

    def results(self) -> list[SimResult]:
        return (
            [r for m in self.measured.values() for r in m.runs.values()]
            + list(self.staleflow.values())
            + list(self.equal.values())
            + list(self.strict.values())
        )


def _scan(cfg: SimConfig, family: list, seed: int, max_eta: int):
    """A search family on one seed, in order, until its worst case passes max_eta (a pool task)."""

    def one(c, s):
        mode, eta, ov, peer = c.args()
        return run_task(cfg, mode, eta, ov, peer, {}, s, c.label)

    return search.scan(family, one, seed, max_eta)


def run_grid(base: SimConfig, jobs: int = 1, progress=print) -> tuple[list[Setting], dict, list[SimResult]]:
    """(settings with all their runs, ablation ratios at the centre, the ablation runs)."""
    sets = [Setting(base, *s) for s in settings()]
    centre = next(s for s in sets if (s.model, s.dist, s.split) == (CENTRE[0], CENTRE[2], CENTRE[3]))
    futures: dict = {}  # future -> handler(result)
    abl: dict = {}  # (label, seed) -> SimResult
    done_settings: set = set()
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:

        def submit(fn, handler, *args):
            futures[pool.submit(fn, *args)] = handler

        def peer_run(st: Setting, c, seed):
            st.pending.add((c, seed))
            mode, eta, ov, peer = c.args()
            submit(
                run_task,
                lambda r, st=st, c=c, seed=seed: st.record(c, seed, r),
                st.cfg,
                mode,
                eta,
                ov,
                peer,
                {},
                seed,
                c.label,
            )

        # Longest chains first: the families of the slow (32B) settings, then single runs.
        for st in sorted(sets, key=lambda s: s.model != "32B"):
            fams = search.families(st.B)
            st.scans_left = len(fams)
            for fam in fams:

                def scanned(out, st=st):
                    for c, r in out:
                        st.record(c, SEEDS[0], r)
                    st.scans_left -= 1

                submit(_scan, scanned, st.cfg, fam, SEEDS[0], max(ETAS))
        for st in sets:
            for eta in ETAS:
                for seed in SEEDS:
                    submit(
                        run_task,
                        lambda r, st=st, k=(eta, seed): st.staleflow.__setitem__(k, r),
                        st.cfg,
                        "staleflow",
                        eta,
                        {},
                        {},
                        {},
                        seed,
                        f"staleflow eta={eta}",
                    )
                    submit(
                        run_task,
                        lambda r, st=st, k=(eta, seed): st.equal.__setitem__(k, r),
                        st.cfg,
                        "staleflow",
                        eta,
                        {},
                        {},
                        equal_transfer(st.cfg),
                        seed,
                        f"staleflow eta={eta} equal-transfer",
                    )
                for c in search.strict(eta, st.B):
                    mode, e, ov, peer = c.args()
                    submit(
                        run_task,
                        lambda r, st=st, c=c: st.strict.__setitem__(c, r),
                        st.cfg,
                        mode,
                        e,
                        ov,
                        peer,
                        {},
                        SEEDS[0],
                        c.label,
                    )
        _, eta, _, _ = CENTRE
        for seed in ABLATION_SEEDS:
            for name, mode, ov, changes in [("full", "staleflow", {}, {})] + list(ABLATIONS):
                submit(
                    run_task,
                    lambda r, k=(name, seed): abl.__setitem__(k, r),
                    centre.cfg,
                    mode,
                    eta,
                    ov,
                    {},
                    changes,
                    seed,
                    f"staleflow eta={eta} {name}",
                )
        while futures:
            finished, _ = wait(list(futures), return_when=FIRST_COMPLETED)
            for f in finished:
                futures.pop(f)(f.result())
            for st in sets:
                if st.scans_left == 0 and not st.pending:  # after the scans: nominal peers, later seeds as needed
                    forced = [c for eta in ETAS for c in search.nominal(eta, st.B)] + [search.fixed("verl-sync")]
                    todo = [
                        (c, seed)
                        for c in forced
                        for seed in SEEDS
                        if seed not in st.measured.get(c, search.Measured(c)).runs
                    ]
                    todo += search.more_seeds(st.measured, ETAS, SEEDS)
                    for c, seed in dict.fromkeys(todo):
                        peer_run(st, c, seed)
                if (
                    st.name not in done_settings
                    and st.scans_left == 0
                    and not st.pending
                    and len(st.staleflow) == len(st.equal) == len(ETAS) * len(SEEDS)
                    and len(st.strict) == 2 * len(ETAS)
                ):
                    done_settings.add(st.name)
                    progress(rep.setting_text(st, ETAS, SEEDS))
    ablation = rep.ablation_ratios(abl, ABLATION_SEEDS)
    return sets, ablation, list(abl.values())


def main(base: SimConfig) -> int:
    t0 = time.perf_counter()
    jobs = base.jobs or os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"staleflow sim --grid paper: {len(settings()) * len(ETAS)} settings (models {[m for m, _, _ in MODELS]}, "
        f"eta {list(ETAS)}, lengths {list(DISTS)}, splits {[f'{a}:{b}' for a, b in SPLITS]}); StaleFlow against "
        f"the fastest peer configuration with observed worst-case staleness <= eta (seeds {list(SEEDS)}), the "
        f"peers at nominal eta, the strict peers and equal transfer; ablations at {CENTRE} over seeds "
        f"{list(ABLATION_SEEDS)}; {base.steps} steps per run, first {base.warmup_steps} not measured, "
        f"B={base.staleness.batch_size} x N={base.staleness.group_size}; {jobs} processes; load average {load:.1f}",
        flush=True,
    )

    def progress(text):
        print(f"\n{text}\n({time.perf_counter() - t0:.0f} s)", flush=True)

    sets, ablation, abl_runs = run_grid(base, jobs, progress)
    rows = [row for st in sets for row in rep.setting_rows(st, ETAS, SEEDS)]
    print(
        "\nSummary: StaleFlow at eta over the guarantee-matched best peer (observed worst case <= eta), over "
        "the same best peer with equal transfer costs, over the best peer at the same nominal eta, over the "
        "strict peers, and over verl-sync; step / floor = StaleFlow's mean step over its tail floor"
    )
    print(rep.summary_table(rows))
    print(
        f"\nAblation at the grid centre {CENTRE} (ablated / full staleflow tokens/s, ratio of the means over seeds "
        f"{list(ABLATION_SEEDS)}): " + ", ".join(f"{k} {v}" for k, v in ablation.items())
    )
    every = [r for st in sets for r in st.results()] + abl_runs
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
