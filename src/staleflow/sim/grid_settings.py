"""The settings of ``staleflow sim --grid paper`` (sim/grid.py runs them): the shapes, the seeds, the paper-like
centre of the ablations, and the configuration changes the grid's columns make (equal transfer, the peers'
redundancy, one token per step).

Settings (``settings()``; 16, 46 rows with eta): the base axes 2 cost models (PSRL's Qwen2.5-7B TP1 and
Qwen2.5-32B TP2 coefficients; KV capacity, prefill/train rates and transfer times derived from the model
and the GPU profile, sim/hardware.py) x 2 response-length distributions (sim/lengths.py) x 2
rollout:train splits of 128 GPUs (64:64, 96:32), B x N of the base config (32 x 8), plus ``EXTRA``: the
authors' two scripts' shapes, the load axis (1024 and 2048 responses per step), the agentic setting (tool
calls between turns, sim/turns.py; ``--grid-settings agentic`` runs it alone) and one 1024-GPU setting
(reduced peer search); eta in {1, 2, 3} unless a setting says otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from staleflow.coordinator.cost_model import load_cost_model
from staleflow.sim import search
from staleflow.sim.config import SimConfig
from staleflow.sim.hardware import derive
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


def grid_base(base: SimConfig) -> SimConfig:
    """The grid's runs: GRID_STEPS steps unless --steps / --warmup-steps were given (--smoke: 12 and 2)."""
    default = SimConfig()
    steps, warmup = base.steps, base.warmup_steps
    if (steps, warmup) == (default.steps, default.warmup_steps):
        steps, warmup = (12, 2) if base.smoke else (GRID_STEPS, GRID_WARMUP)
    return dataclasses.replace(base, steps=steps, warmup_steps=warmup)


def centre_cfg(steps: int = 0, seed: int = 0) -> tuple[SimConfig, int]:
    """(the grid's config of its CENTRE setting, the centre's eta): what a script studying the centre starts from;
    `steps` > 0 shortens the run (a third of them at most not measured)."""
    name, eta = CENTRE
    base = grid_base(SimConfig())
    if steps:
        base = dataclasses.replace(base, steps=steps, warmup_steps=min(base.warmup_steps, steps // 3))
    shape = next(s for s in settings() if s.name == name)
    return dataclasses.replace(setting_cfg(base, shape), seed=seed), eta


def _matches(pick: str, name: str) -> bool:
    """A --grid-settings entry: a substring of the name, or with a trailing '$' its ending."""
    return name.endswith(pick[:-1]) if pick.endswith("$") else pick in name


def fair(cfg: SimConfig) -> dict:
    """SimConfig changes that give StaleFlow the peers' redundancy (none: N' = N, B' = B) for the strongest-fair
    column; {} where it has none already (every setting but the authors' 30B-A3B, which generates 17 of 16)."""
    st = cfg.staleness
    if st.batch_redundancy == 0 and st.group_redundancy == 0:
        return {}
    return {"staleness": dataclasses.replace(st, batch_redundancy=0, group_redundancy=0, straggler="off")}


LANES = {"tail_lanes": True}
"""Coordinator overrides of StaleFlow's runs with tail lanes (off by default; with ONE_TOKEN: the critical slowdown
with them, beside the default runs' without)."""
ONE_TOKEN = {"spec_accept": 1.0}
"""One token per decode step (no speculative decoding): the runs whose step the physical floor bounds."""
SPEC_SWEEP = (1.0, 1.5, 2.5, 3.0)
"""Speculative acceptances (tokens per verify forward) swept at the centre beside the default (SimConfig)."""
