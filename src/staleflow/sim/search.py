"""The guarantee-matched peer search of ``staleflow sim --grid paper`` (sim/grid.py).

The headline compares StaleFlow at eta with the FASTEST configuration of each peer whose OBSERVED
worst-case staleness is <= eta: every trained group of every seed (``SEEDS``, warm-up included),
max(V_buf - V_traj). An observed maximum is not a guarantee (a longer run, another seed or another
length tail can exceed it); StaleFlow's bound holds by construction.

The peers' knobs, each a family scanned in ascending order (coordinator/modes.PEER_OPTIONS):
  verl fully-async, partial rollout: trigger_parameter_sync_step T in 1..4 and staleness_threshold
      s on a fine grid with fractions (verl takes a decimal); the run's nominal eta is
      ceil((1 + s) T) - 1 (it only sizes the prompt supply and the nominal column);
  verl fully-async, partial_rollout=False (T = 1): a sync waits for all in-flight work to finish;
  AReaL: max_head_offpolicyness 0, 1, 2, ... for each concurrency cap (B, AReaL's default; 2 B;
      (eta + 1) B, which never binds);
  verl-sync (worst 0) and verl-one-step-off (worst 1): one configuration each.
A family stops at its first value whose seed-0 worst case exceeds the largest eta compared: the
worst case grows with s, T and max_head_offpolicyness (more admitted ahead of the trainer), so
larger values cannot qualify (``tests/test_guarantee.py`` checks the ordering on small runs).
The other seeds run only where they can decide the winner (``more_seeds``): a configuration
whose seed-0 throughput is more than ``MARGIN`` below the best fully measured qualifying one is
not rerun (seed-to-seed spread is 1-2 %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SEEDS = (0, 1)
MARGIN = 0.05
S_GRID = {
    1: (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0),
    2: (0.0, 0.1, 0.25, 0.5, 0.75, 1.0),
    3: (0.0, 0.1, 0.25, 0.5),
    4: (0.0, 0.1, 0.25),
}
"""verl staleness_threshold values per trigger_parameter_sync_step T (scanned in this order)."""
S_NO_PARTIAL = (0.5, 1.0, 2.0, 3.0)
"""partial_rollout=False (T = 1): every sync waits for all in-flight work, so s barely moves throughput."""
AREAL_ETAS = (0, 1, 2, 3, 4, 5)


@dataclass(frozen=True)
class PeerConfig:
    """One configuration of a peer: the mode, its nominal eta, protocol knobs and coordinator overrides."""

    mode: str
    eta: int
    peer: tuple = ()
    """((knob, value), ...) for coordinator/modes.build_protocol."""
    overrides: tuple = ()
    """((field, value), ...) coordinator overrides (partial_rollout=False: interrupt_on_pull False)."""
    label: str = ""

    def args(self) -> tuple[str, int, dict, dict]:
        return self.mode, self.eta, dict(self.overrides), dict(self.peer)


def verl(s: float, T: int = 1, partial: bool = True, strict: bool = False) -> PeerConfig:
    peer = [("staleness_threshold", float(s))]
    if T != 1:
        peer.append(("trigger_sync_steps", T))
    if strict:
        peer.append(("strict", True))
    eta = int(s) if strict else max(0, math.ceil(round((1 + s) * T, 6)) - 1)
    label = (
        f"verl-fully-async s={s:g}"
        + (f" T={T}" if T != 1 else "")
        + ("" if partial else " no-partial")
        + (" strict" if strict else "")
    )
    return PeerConfig("verl-fully-async", eta, tuple(peer), () if partial else (("interrupt_on_pull", False),), label)


def areal(eta: int, cap: int, batch_size: int, strict: bool = False) -> PeerConfig:
    peer = [("max_concurrent", cap)] + ([("strict", True)] if strict else [])
    cap_s = "B" if cap == batch_size else f"{cap // batch_size}B" if cap % batch_size == 0 else str(cap)
    return PeerConfig("areal", eta, tuple(peer), (), f"areal eta={eta} cap={cap_s}" + (" strict" if strict else ""))


def fixed(mode: str) -> PeerConfig:
    return PeerConfig(mode, {"verl-sync": 0, "verl-one-step-off": 1}[mode], (), (), mode)


def nominal(eta: int, batch_size: int) -> list[PeerConfig]:
    """The peers at the same nominal eta (the previous headline): verl s = eta (T = 1), AReaL eta with the
    cap (eta + 1) B that never binds."""
    return [verl(float(eta)), areal(eta, (eta + 1) * batch_size, batch_size)]


def strict(eta: int, batch_size: int) -> list[PeerConfig]:
    """Strict variants at nominal eta: groups beyond eta are dropped and regenerated (shorter responses)."""
    return [verl(float(eta), strict=True), areal(eta, (eta + 1) * batch_size, batch_size, strict=True)]


def families(batch_size: int) -> list[list[PeerConfig]]:
    """Every scanned family, each in ascending order of the knob that raises the worst case."""
    B = batch_size
    out = [[verl(s, T) for s in S_GRID[T]] for T in sorted(S_GRID)]
    out.append([verl(s, 1, partial=False) for s in S_NO_PARTIAL])
    # Caps B (AReaL's default), 2 B and (eta + 1) B (never binds); a cap above (eta + 1) B is the same as
    # (eta + 1) B, so each (eta, cap) pair appears in one family only.
    out.append([areal(e, B, B) for e in AREAL_ETAS])
    out.append([areal(e, 2 * B, B) for e in AREAL_ETAS if e >= 1])
    out.append([areal(e, (e + 1) * B, B) for e in AREAL_ETAS if e >= 2])
    out.append([fixed("verl-sync")])
    out.append([fixed("verl-one-step-off")])
    return out


@dataclass
class Measured:
    """A configuration's runs by seed and what the search reads off them."""

    cfg: PeerConfig
    runs: dict = field(default_factory=dict)
    """seed -> SimResult"""

    @property
    def tok_s(self) -> float:
        return sum(r.tokens_per_s for r in self.runs.values()) / max(1, len(self.runs))

    @property
    def worst(self) -> int:
        return max((max(r.staleness_hist, default=0) for r in self.runs.values()), default=0)

    @property
    def mean_staleness(self) -> float:
        n = sum(sum(r.staleness_hist.values()) for r in self.runs.values())
        return sum(k * v for r in self.runs.values() for k, v in r.staleness_hist.items()) / max(1, n)

    def over(self, eta: int) -> float:
        """Fraction of trained groups with staleness > eta."""
        n = sum(sum(r.staleness_hist.values()) for r in self.runs.values())
        return sum(v for r in self.runs.values() for k, v in r.staleness_hist.items() if k > eta) / max(1, n)

    def complete(self, seeds) -> bool:
        return all(s in self.runs for s in seeds)


def scan(family: list[PeerConfig], run_one, seed: int, max_eta: int) -> list[tuple[PeerConfig, object]]:
    """Run a family in order on one seed, stopping after the first configuration whose worst case
    exceeds max_eta (larger knobs only raise it). run_one(cfg, seed) -> SimResult."""
    out = []
    for cfg in family:
        r = run_one(cfg, seed)
        out.append((cfg, r))
        if max(r.staleness_hist, default=0) > max_eta:
            break
    return out


def qualifying(measured: dict, eta: int) -> list[Measured]:
    return [m for m in measured.values() if m.runs and m.worst <= eta]


def best(measured: dict, eta: int, seeds=SEEDS) -> Measured | None:
    """The fastest configuration measured on every seed whose observed worst case is <= eta."""
    return max((m for m in qualifying(measured, eta) if m.complete(seeds)), key=lambda m: m.tok_s, default=None)


def more_seeds(measured: dict, etas, seeds=SEEDS, margin: float = MARGIN) -> list[tuple[PeerConfig, int]]:
    """(configuration, seed) runs still needed to decide each eta's winner: every qualifying configuration
    not yet measured on all seeds whose throughput so far is within `margin` of the best qualifying one."""
    need = {}
    for eta in etas:
        q = qualifying(measured, eta)
        if not q:
            continue
        top = max(m.tok_s for m in q)
        for m in q:
            if not m.complete(seeds) and m.tok_s >= (1 - margin) * top:
                for s in seeds:
                    if s not in m.runs:
                        need[(m.cfg, s)] = True
    return list(need)


def search(run_one, batch_size: int, etas, seeds=SEEDS, margin: float = MARGIN, forced=()) -> tuple[dict, dict]:
    """The whole search, sequentially (tests; the grid runs the same steps in a process pool).
    Returns ({cfg: Measured}, {eta: Measured | None}); `forced` configurations run on every seed."""
    measured: dict = {}

    def record(cfg, seed, r):
        measured.setdefault(cfg, Measured(cfg)).runs[seed] = r

    for fam in families(batch_size):
        for cfg, r in scan(fam, run_one, seeds[0], max(etas)):
            record(cfg, seeds[0], r)
    for cfg in forced:
        for s in seeds:
            if s not in measured.get(cfg, Measured(cfg)).runs:
                record(cfg, s, run_one(cfg, s))
    while True:
        todo = more_seeds(measured, etas, seeds, margin)
        if not todo:
            break
        for cfg, s in todo:
            record(cfg, s, run_one(cfg, s))
    return measured, {eta: best(measured, eta, seeds) for eta in etas}
