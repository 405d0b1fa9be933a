"""The guarantee-matched peer search of ``staleflow sim --grid paper`` (sim/grid.py).

The headline compares StaleFlow at eta with the FASTEST configuration of each peer whose OBSERVED
worst-case staleness is <= eta: every trained group of every seed (``SEEDS``, warm-up included),
max(V_buf - V_traj). An observed maximum is not a guarantee (a longer run, another seed or another
length tail can exceed it); StaleFlow's bound holds by construction.

The peers' knobs, each a family scanned in ascending order (each registered peer's ``Mode.families``,
staleflow.modes; a fork's peer named in --modes too):
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

from dataclasses import dataclass, field

from staleflow.faults import ConfigError
from staleflow.modes import Mode, PeerConfig, mode_of, peers

SEEDS = (0, 1)
MARGIN = 0.05


def peer_modes(modes=None) -> list[Mode]:
    """The peers to search: those among ``modes`` (registered names or forks' import paths), in that order;
    None: every registered peer."""
    return peers() if modes is None else [m for m in (mode_of(x) for x in modes) if m.peer]


def fixed(mode: str) -> PeerConfig:
    """A fixed-eta peer's one configuration (verl-sync, verl-one-step-off)."""
    m = mode_of(mode)
    return PeerConfig(m.name, m.fixed_eta, (), (), m.name)


def nominal(eta: int, batch_size: int, modes=None) -> list[PeerConfig]:
    """The peers at the same nominal eta (the previous headline): each peer's own (verl s = eta with T = 1,
    AReaL eta with the cap (eta + 1) B that never binds)."""
    return [c for m in peer_modes(modes) for c in m.nominal(eta, batch_size)]


def strict(eta: int, batch_size: int, modes=None) -> list[PeerConfig]:
    """Strict variants at nominal eta: groups beyond eta are dropped and regenerated (shorter responses)."""
    return [c for m in peer_modes(modes) for c in m.strict(eta, batch_size)]


def families(batch_size: int, modes=None) -> list[list[PeerConfig]]:
    """Every scanned family of every peer (Mode.families), each in ascending order of the knob that raises
    the worst case."""
    return [fam for m in peer_modes(modes) for fam in m.families(batch_size)]


class PeerSet:
    """The peers one grid setting searches (those among --modes) at batch size B: their families, their
    configurations at nominal eta and strict, and the synchronous baseline's (the x-sync column)."""

    def __init__(self, modes, batch_size: int):
        self.modes, self.B = modes, batch_size

    def families(self, reduced_eta: int | None = None) -> list[list[PeerConfig]]:
        """Every family; ``reduced_eta``: the reduced search's (each Mode's reduced_families, e.g. verl s = 0 over T,
        and the synchronous baseline)."""
        if reduced_eta is None:
            return families(self.B, self.modes)
        return [f for m in peer_modes(self.modes) for f in m.reduced_families(reduced_eta)]

    def nominal(self, eta: int) -> list[PeerConfig]:
        return nominal(eta, self.B, self.modes)

    def strict(self, eta: int) -> list[PeerConfig]:
        return strict(eta, self.B, self.modes)

    def sync(self) -> list[PeerConfig]:
        return [fixed(m.name) for m in peer_modes(self.modes) if m.fixed_eta == 0]

    def check(self) -> None:
        """ConfigError unless some peer has a nominal and a strict configuration (the grid's columns)."""
        if not (self.nominal(1) and self.strict(1)):
            raise ConfigError(
                f"--modes={' '.join(self.modes)!r}: the grid compares StaleFlow with peers at nominal eta and their "
                f"strict variants; name at least one peer that has them (verl-fully-async, areal)"
            )


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


def best(measured: dict, eta: int, seeds=SEEDS, keep=None) -> Measured | None:
    """The fastest configuration measured on every seed whose observed worst case is <= eta (``keep``: only the
    PeerConfigs it accepts)."""
    cands = (m for m in qualifying(measured, eta) if m.complete(seeds) and (keep is None or keep(m.cfg)))
    return max(cands, key=lambda m: m.tok_s, default=None)


def more_seeds(
    measured: dict, etas, seeds=SEEDS, margin: float = MARGIN, keeps=(None,)
) -> list[tuple[PeerConfig, int]]:
    """(configuration, seed) runs still needed to decide each eta's winner: every qualifying configuration
    not yet measured on all seeds whose throughput so far is within `margin` of the best qualifying one (of each
    peer set ``keeps`` names: None, every peer; else a predicate on PeerConfig, e.g. the grid's today's peers)."""
    need = {}
    for eta in etas:
        for keep in keeps:
            q = [m for m in qualifying(measured, eta) if keep is None or keep(m.cfg)]
            if not q:
                continue
            top = max(m.tok_s for m in q)
            for m in q:
                if not m.complete(seeds) and m.tok_s >= (1 - margin) * top:
                    for s in seeds:
                        if s not in m.runs:
                            need[(m.cfg, s)] = True
    return list(need)


def search(
    run_one, batch_size: int, etas, seeds=SEEDS, margin: float = MARGIN, forced=(), modes=None
) -> tuple[dict, dict]:
    """The whole search, sequentially (tests; the grid runs the same steps in a process pool).
    Returns ({cfg: Measured}, {eta: Measured | None}); `forced` configurations run on every seed."""
    measured: dict = {}

    def record(cfg, seed, r):
        measured.setdefault(cfg, Measured(cfg)).runs[seed] = r

    for fam in families(batch_size, modes):
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
