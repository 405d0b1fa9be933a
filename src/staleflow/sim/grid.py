"""``staleflow sim --grid paper``: the evaluation grid, StaleFlow against peers held to the same guarantee.

Settings (``settings()``; 16, 46 rows with eta): the base axes 2 cost models (PSRL's Qwen2.5-7B TP1 and
Qwen2.5-32B TP2 coefficients; KV capacity, prefill/train rates and transfer times derived from the model
and the GPU profile, sim/hardware.py) x 2 response-length distributions (sim/lengths.py) x 2
rollout:train splits of 128 GPUs (64:64, 96:32), B x N of the base config (32 x 8), plus ``EXTRA``: the
authors' two scripts' shapes, the load axis (1024 and 2048 responses per step), the agentic setting (tool
calls between turns, sim/turns.py; ``--grid-settings agentic`` runs it alone) and one 1024-GPU setting
(reduced peer search); eta in {1, 2, 3} unless a setting says otherwise. Every row reports each system's
mean step over its physical floor (sim/floor.py), the rollout utilisation at the floor and the binding
term (>= 0.5: throughput-bound). ``--grid-settings`` runs a subset, ``--smoke`` the authors' shapes only.

The headline (per setting and eta): StaleFlow at eta against the FASTEST peer configuration whose
OBSERVED worst-case staleness is <= eta (sim/search.py: verl fully-async's staleness_threshold and
trigger_parameter_sync_step, its partial_rollout=False mode, AReaL's max_head_offpolicyness and
concurrency cap, verl-sync, verl-one-step-off; worst case over every trained group of ``SEEDS``).
Secondary columns, each labelled: the peers at the same NOMINAL eta (with their fraction of groups
beyond eta and mean staleness), the STRICT variants that drop and regenerate over-stale groups
(seed 0 only), and EQUAL TRANSFER (StaleFlow's push and pulls at the peers' broadcast bandwidth, the
push holding the trainer). StaleFlow runs on every seed of ``SEEDS``; ratios are of seed means.
Ablations (report.ABLATIONS) run at the paper-like ``CENTRE`` over ``ABLATION_SEEDS``. Every run is one task
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
from dataclasses import dataclass

from staleflow.config import ConfigError
from staleflow.coordinator.cost_model import load_cost_model
from staleflow.sim import grid_report as rep
from staleflow.sim import search
from staleflow.sim.config import SimConfig
from staleflow.sim.hardware import derive
from staleflow.sim.report import ABLATIONS
from staleflow.sim.simulator import SimResult, run
from staleflow.sim.turns import AGENTIC

MODELS = (("7B", "qwen2.5-7b-tp1", 1), ("32B", "qwen2.5-32b-tp2", 2))
ETAS = (1, 2, 3)
DISTS = ("lognormal", "long-cot")
SPLITS = ((64, 64), (96, 32))
SEEDS = search.SEEDS
ABLATION_SEEDS = (0, 1, 2)
GRID_STEPS, GRID_WARMUP = 24, 4
"""Steps per grid run (first GRID_WARMUP not measured) unless --steps is given: the load axis's runs decode
1-2k responses per step, and the seeds agree to a few % at 20 measured steps (docs/simulator.md)."""


@dataclass(frozen=True)
class Shape:
    """One setting of the grid: model, GPUs, workload. batch / group None: the base config's."""

    name: str
    model: str
    cost_model: str
    tp: int
    dist: str
    split: tuple[int, int]
    batch: int | None = None
    group: int | None = None
    group_redundancy: int = 0
    """N' - N: redundant responses per prompt (StaleFlow only; the peers generate N)."""
    cap: int | None = None
    etas: tuple[int, ...] | None = None
    """None: ETAS."""
    search: str = "full"
    """'full': every peer family; 'reduced': verl s = 0 over T (the winner elsewhere) and verl-sync only."""
    workload: tuple = ()
    """((SimConfig field, value), ...) of the setting's workload beyond the base (the agentic setting's tools)."""


EXTRA = (
    # The authors' scripts (docs/simulator.md): Qwen3-30B-A3B, 24 rollout GPUs (TP1) + 40 trainer GPUs,
    # 32 prompts x 16 responses + 1 redundant, 40k cap, eta 3 (their "all strategies" script; eta 1-3 here) ...
    Shape("30B-A3B authors 24:40", "30B-A3B", "qwen3-30b-a3b", 1, "long-cot", (24, 40), 32, 16, 1, 40000),
    # ... and Qwen2.5-32B, 16 rollout GPUs at TP4 + 32 trainer GPUs, 256 prompts x 8, 20k cap.
    Shape("32B-TP4 authors 16:32", "32B", "qwen2.5-32b-tp4", 4, "long-cot", (16, 32), 256, 8, 0, 20000),
    # The load axis: 1024 and 2048 responses per step on 128 GPUs.
    Shape("7B long-cot 32:96 x1024", "7B", "qwen2.5-7b-tp1", 1, "long-cot", (32, 96), 128, 8),
    Shape("7B long-cot 32:96 x2048", "7B", "qwen2.5-7b-tp1", 1, "long-cot", (32, 96), 256, 8),
    Shape("32B long-cot 64:64 x1024", "32B", "qwen2.5-32b-tp2", 2, "long-cot", (64, 64), 128, 8),
    Shape("32B long-cot 64:64 x2048", "32B", "qwen2.5-32b-tp2", 2, "long-cot", (64, 64), 256, 8),
    # The agentic setting: 7B lognormal 64:64's model tokens with tool calls between turns (turns.AGENTIC).
    Shape("7B agentic 64:64", "7B", "qwen2.5-7b-tp1", 1, "lognormal", (64, 64), workload=AGENTIC),
    # One 1024-GPU setting (eta 2, reduced peer search: each run simulates 256 instances).
    Shape(
        "32B long-cot 512:512 x4096",
        "32B",
        "qwen2.5-32b-tp2",
        2,
        "long-cot",
        (512, 512),
        512,
        8,
        etas=(2,),
        search="reduced",
    ),
)
CENTRE = ("30B-A3B authors 24:40", 3)
"""(setting, eta) of the ablations: the paper-like centre, the authors' all-strategies shape at its eta."""
SMOKE = ("30B-A3B authors 24:40", "32B-TP4 authors 16:32")
"""--smoke: the authors' two shapes only, short runs, one seed of ablations."""


def setting_cfg(base: SimConfig, shape: Shape) -> SimConfig:
    st = base.staleness
    staleness = dataclasses.replace(
        st,
        batch_size=shape.batch or st.batch_size,
        group_size=shape.group or st.group_size,
        group_redundancy=shape.group_redundancy,
    )
    return dataclasses.replace(
        base,
        cost_model=shape.cost_model,
        gpus_per_instance=shape.tp,
        length_dist=shape.dist,
        total_gpus=sum(shape.split),
        rollout_gpus=shape.split[0],
        staleness=staleness,
        max_response=shape.cap or base.max_response,
        out_dir="",
        **dict(shape.workload),
    )


def equal_transfer(cfg: SimConfig) -> dict:
    """SimConfig changes that give StaleFlow the peers' weight-transfer cost: push and every pull at the
    broadcast bandwidth, and the push holds the trainer (as the peers' broadcast does)."""
    b = derive(cfg, load_cost_model(cfg.cost_model)).broadcast_s
    return {"push_s": b, "pull_s": b, "push_blocks_trainer": True}


def settings() -> list[Shape]:
    """Every setting, grid order: models x length distributions x splits (B x N of the base), then EXTRA."""
    base = [Shape(f"{m} {d} {sp[0]}:{sp[1]}", m, cm, tp, d, sp) for m, cm, tp in MODELS for d in DISTS for sp in SPLITS]
    return base + list(EXTRA)


def run_task(
    cfg: SimConfig, mode: str, eta: int, overrides: dict, peer: dict, changes: dict, seed: int, label: str
) -> SimResult:
    """One simulated run (a process-pool task)."""
    cfg = dataclasses.replace(cfg, seed=seed, **changes)
    return run(cfg, mode, eta, overrides, f"{label} seed={seed}", peer=peer)


class Setting:
    """Every run of one setting: the peer search, StaleFlow (and equal transfer), the strict peers."""

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
            + list(self.strict.values())
        )


def _scan(cfg: SimConfig, family: list, seed: int, max_eta: int):
    """A search family on one seed, in order, until its worst case passes max_eta (a pool task)."""

    def one(c, s):
        mode, eta, ov, peer = c.args()
        return run_task(cfg, mode, eta, ov, peer, {}, s, c.label)

    return search.scan(family, one, seed, max_eta)


def run_grid(
    base: SimConfig, jobs: int = 1, progress=print, shapes=None, centre=None, ablation_seeds=None
) -> tuple[list[Setting], dict, list[SimResult]]:
    """(settings with all their runs, ablation ratios at the centre, the ablation runs)."""
    sets = [Setting(base, sh) for sh in (shapes if shapes is not None else settings())]
    centre_name, centre_eta = centre or CENTRE
    abl_seeds = ABLATION_SEEDS if ablation_seeds is None else ablation_seeds
    centre_set = next(s for s in sets if s.name == centre_name)
    futures: dict = {}  # future -> handler(result)
    abl: dict = {}  # (label, seed) -> SimResult
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
                    one(
                        st,
                        lambda r, st=st, k=k: st.equal.__setitem__(k, r),
                        "staleflow",
                        eta,
                        {},
                        {},
                        equal_transfer(st.cfg),
                        seed,
                        f"staleflow eta={eta} equal-transfer",
                    )
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
                    todo += search.more_seeds(st.measured, st.etas, SEEDS)
                    for c, seed in dict.fromkeys(todo):
                        peer_run(st, c, seed)
                if (
                    st.name not in done_settings
                    and st.scans_left == 0
                    and not st.pending
                    and len(st.staleflow) == len(st.equal) == len(st.etas) * len(SEEDS)
                    and len(st.strict) == sum(len(st.peers.strict(eta)) for eta in st.etas)
                ):
                    done_settings.add(st.name)
                    progress(rep.setting_text(st, st.etas, SEEDS))
    ablation = rep.ablation_ratios(abl, abl_seeds) if abl_seeds else {}
    return sets, ablation, list(abl.values())


def grid_base(base: SimConfig) -> SimConfig:
    """The grid's runs: GRID_STEPS steps unless --steps / --warmup-steps were given (--smoke: 12 and 2)."""
    default = SimConfig()
    steps, warmup = base.steps, base.warmup_steps
    if (steps, warmup) == (default.steps, default.warmup_steps):
        steps, warmup = (12, 2) if base.smoke else (GRID_STEPS, GRID_WARMUP)
    return dataclasses.replace(base, steps=steps, warmup_steps=warmup)


def _matches(pick: str, name: str) -> bool:
    """A --grid-settings entry: a substring of the name, or with a trailing '$' its ending."""
    return name.endswith(pick[:-1]) if pick.endswith("$") else pick in name


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
        f"peer configuration with observed worst-case staleness <= eta (seeds {list(SEEDS)}), the peers at nominal "
        f"eta, the strict peers and equal transfer; every run's physical floor; ablations at {centre} over seeds "
        f"{list(abl_seeds)}; {base.steps} steps per run, first {base.warmup_steps} not measured; {jobs} processes; "
        f"load average {load:.1f}",
        flush=True,
    )

    def progress(text):
        print(f"\n{text}\n({time.perf_counter() - t0:.0f} s)", flush=True)

    sets, ablation, abl_runs = run_grid(base, jobs, progress, shapes, centre, abl_seeds)
    rows = [row for st in sets for row in rep.setting_rows(st, st.etas, SEEDS)]
    print(
        "\nSummary: StaleFlow at eta over the guarantee-matched best peer (observed worst case <= eta), over "
        "the same best peer with equal transfer costs, over the best peer at the same nominal eta, over the "
        "strict peers, and over verl-sync; util = rollout utilisation at the physical floor (>= 0.5: "
        "throughput-bound), binds = the floor's largest term, st/fl = each system's mean step over its own floor"
    )
    print(rep.summary_table(rows))
    print(
        f"\nAblation at the paper-like centre {centre} (ablated / full staleflow tokens/s, ratio of the means over "
        f"seeds {list(abl_seeds)}): " + ", ".join(f"{k} {v}" for k, v in ablation.items())
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
