"""The PipelineRL peer (modes/pipelinerl.py, docs/baselines.md) and what "fair" means for every peer (issue 49):
its admission and batch rule against hand-worked cases, its in-flight weight update through the shared loop
(every instance at once, nothing interrupted, the trainer and routing held), the rule that holds it to the bound
(pipelinerl-reserve, the strict variant), and the fair engine mechanisms of the simulated peers (the same
transfer bandwidth, speculative decoding for all, keep-KV where the peer's code keeps it, no redundancy)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from controller_fakes import Prompts, ScriptedBackend

from staleflow.config import CoordinatorConfig, RunConfig, StalenessConfig, resolve
from staleflow.controller import Finished, Published, PullDone
from staleflow.controller.build import build_loop
from staleflow.coordinator import CostModel, Interrupt, Pull, Route
from staleflow.modes import apply_mode, build_protocol, mode_of, peers
from staleflow.modes.pipelinerl import PipelineRLBuffer
from staleflow.protocol import ProtocolError, StalenessManager, StalenessSpec

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import sim_config, tiny_sim  # noqa: E402

COST = CostModel(k1=1e-7, k2=0.02, k3=2e-4, b3=0.01, k4=1e-3, kv_capacity=100_000, name="test")


def start(m, gid, V=0):
    m.reserve(f"{gid}.0", gid, V)


def finish(m, gid):
    m.complete(f"{gid}.0")
    m.occupy(gid)


# ---- the batch rule ------------------------------------------------------------------------------------------
def test_pipelinerl_admission_is_lag_groups_plus_b_per_version_seen():
    """ActorLoop._run: submitted groups < lag_groups + B x (1 + versions seen); finishing frees nothing."""
    m = PipelineRLBuffer(StalenessSpec(eta=1, batch_size=2), lag_groups=1)
    for g in range(3):  # 1 + 2 x (0 + 1)
        assert m.can_admit(0)
        start(m, g)
    assert not m.can_admit(0)
    finish(m, 0)
    assert not m.can_admit(0)  # an admission limit on submissions, not on groups in flight
    m.on_rollout_version(1)  # the instances run version 1: B more
    assert m.can_admit(0) and m.stats()["budget"] == 5


def test_pipelinerl_batches_first_b_completed_and_trains_beyond_the_lag():
    """FIFO batches of the first B completed groups; a straggler overtaken is trained late and counted, not dropped
    (the trainer's samples_too_old_to_train): PipelineRL's own rule holds no per-trajectory bound."""
    m = PipelineRLBuffer(StalenessSpec(eta=1, batch_size=1), lag_groups=8)
    for g in range(4):
        start(m, g)
    for g in (1, 2, 3):
        finish(m, g)
    assert m.consume(0) == [1] and m.consume(1) == [2] and m.consume(2) == [3]
    finish(m, 0)  # started at version 0, trained in buffer 3: staleness 3 > eta 1 (and group 3's 2)
    assert m.consume(3) == [0] and m.over_eta() == 2 and m.consumption_log()[-1] == (0, 0, 3)
    m.validate()


def test_pipelinerl_strict_variant_drops_a_group_beyond_eta_and_gives_its_place_back():
    m = PipelineRLBuffer(StalenessSpec(eta=1, batch_size=1), lag_groups=8, strict=True)
    for g in range(3):
        start(m, g)
    finish(m, 1)
    finish(m, 2)
    m.consume(0)
    m.consume(1)  # next batch 2: group 0 (V_traj 0) can no longer be trained within eta 1
    assert m.closed_windows() == [0]
    before = m.submitted
    m.abort_group(0, "window-closed")
    assert m.submitted == before - 1 and m.over_eta() == 0
    with pytest.raises(ProtocolError, match="lag_groups"):
        PipelineRLBuffer(StalenessSpec(eta=1, batch_size=1), lag_groups=-1)


def test_pipelinerl_modes_build_their_protocols_and_settings():
    assert isinstance(build_protocol("pipelinerl", StalenessSpec(2, 4)), PipelineRLBuffer)
    assert build_protocol("pipelinerl", StalenessSpec(2, 4)).lag_groups == 8  # -1: eta x B
    assert build_protocol("pipelinerl", StalenessSpec(2, 4), peer={"lag_groups": 3}).lag_groups == 3
    reserve = build_protocol("pipelinerl-reserve", StalenessSpec(2, 4))
    assert type(reserve) is StalenessManager and reserve.exchange is False  # NeMo-RL's reservation, no exchange
    cfg = resolve(RunConfig(mode="pipelinerl"))
    c = cfg.coordinator
    assert (c.pull, c.keep_kv_on_pull, c.interrupt_on_pull, c.routing, c.migration) == (
        "pause-all",
        True,
        True,
        "least-loaded",
        False,
    )
    assert cfg.staleness.group_redundancy == 0 and mode_of("pipelinerl").weight_sync == "broadcast"


# ---- the in-flight weight update through the shared loop -----------------------------------------------------
@pytest.mark.parametrize("mode", ["pipelinerl", "pipelinerl-reserve"])
def test_pipelinerl_update_pauses_every_instance_interrupts_nothing_and_holds_the_trainer(mode):
    ccfg, stale = apply_mode(mode, CoordinatorConfig(), StalenessConfig(eta=2, batch_size=2, group_size=1))
    be = ScriptedBackend(reward=1.0)
    loop = build_loop(mode, stale, ccfg, COST, range(2), be, Prompts(), 5)

    def step(*events):
        be.events.extend(events)
        loop.turn(be.now())
        loop.tick(be.now())
        loop.maybe_train()

    step()
    first = [c for c in be.sent if isinstance(c, Route)]
    assert {r.instance for r in first} == {0, 1}  # least-loaded: both engines
    step(*[Finished(r.traj_id, r.instance, f"h{r.traj_id}", 5) for r in first])  # (reserve: buffer 0 needs its own)
    assert [v for v, _ in be.trained] == [0]
    be.sent.clear()
    step(Published(1))  # one update, every engine at once, nothing interrupted (the running requests keep KV)
    assert sorted(c.instance for c in be.sent if isinstance(c, Pull)) == [0, 1]
    assert not [c for c in be.sent if isinstance(c, Interrupt)]
    step(PullDone(0, 1))
    assert loop.coord.trainer_blocked() and not [c for c in be.sent if isinstance(c, Route)]  # broadcast in progress
    step(PullDone(1, 1))
    assert not loop.coord.trainer_blocked() and [c for c in be.sent if isinstance(c, Route)]


def test_pipelinerl_reserve_is_bounded_in_the_simulator_and_keeps_kv():
    from staleflow.sim.simulator import run

    for mode in ("pipelinerl", "pipelinerl-reserve"):
        r = run(tiny_sim(), mode, 1)
        assert r.violations == [] and r.pulls > 0 and r.interrupts == 0  # in-flight updates: nothing interrupted
    assert max(run(tiny_sim(seed=3), "pipelinerl-reserve", 1).staleness_hist) <= 1


def test_pipelinerl_search_families_scan_the_lag_and_the_bound():
    (lag,) = mode_of("pipelinerl").families(8)
    assert [c.label for c in lag][:3] == ["pipelinerl lag=0B", "pipelinerl lag=0.25B", "pipelinerl lag=0.5B"]
    assert dict(lag[-1].peer) == {"lag_groups": 24} and lag[-1].eta == 3  # nominal eta: ceil of the lag in batches
    (reserve,) = mode_of("pipelinerl-reserve").families(8)
    assert [(c.mode, c.eta) for c in reserve] == [("pipelinerl-reserve", e) for e in (1, 2, 3)]
    assert [c.label for c in mode_of("pipelinerl").strict(2, 8)] == ["pipelinerl lag=2B strict"]


# ---- fair peers ----------------------------------------------------------------------------------------------
def test_fair_peer_transfer_bandwidth_is_staleflows_pull_by_default():
    from staleflow.coordinator.cost_model import load_cost_model
    from staleflow.sim.hardware import derive

    cfg = sim_config(cost_model="qwen2.5-32b-tp2")
    hw = derive(cfg, load_cost_model(cfg.cost_model))
    assert hw.broadcast_s == pytest.approx(hw.pull_s)  # 32 GB/s into an instance, every system
    slow = derive(dataclasses.replace(cfg, broadcast_gb_s=8.25), load_cost_model(cfg.cost_model))
    assert slow.broadcast_s == pytest.approx(hw.pull_s * 32 / 8.25)


def test_fair_peer_keep_kv_only_where_the_peers_code_keeps_it():
    kept = {m.name: apply_mode(m.name, CoordinatorConfig())[0].keep_kv_on_pull for m in peers()}
    assert kept == {
        "verl-sync": False,
        "verl-one-step-off": False,
        "verl-fully-async": False,
        "areal": False,
        "pipelinerl": True,  # vllm1.py: pause_generation(mode="keep", clear_cache=False)
        "pipelinerl-reserve": True,
    }


def test_fair_peer_speculative_decoding_for_every_mode_and_no_redundancy():
    from staleflow.sim.grid import fair, setting_cfg, settings
    from staleflow.sim.simulator import run

    for mode in ("pipelinerl", "areal", "staleflow"):
        assert run(tiny_sim(spec_accept=2.0), mode, 1).spec_frac > 0  # the engine speculates in every mode
    moe = next(sh for sh in settings() if sh.name.startswith("30B-A3B"))
    cfg = setting_cfg(sim_config(), moe)
    assert cfg.staleness.group_redundancy == 1 and fair(cfg)["staleness"].group_redundancy == 0
    assert fair(sim_config()) == {}  # no redundancy to remove


@pytest.mark.slow
def test_pipelinerl_reserve_runs_on_the_real_runtime_with_in_flight_updates_and_the_bound_holds(tmp_path):
    """The registered mode on the real runtime (torchrun: 1 trainer + 2 rollout ranks + controller, tiny preset):
    every weight update pulls with nothing interrupted (the in-flight update keeps the KV), every trained group is
    within eta (NeMo-RL's per-trajectory rule), nothing is trained twice."""
    from run_helpers import QUIET, metrics_rows, train_tiny
    from test_e2e import _check_audit

    eta = 1
    flags = ("--mode", "pipelinerl-reserve", "--steps", "4", "--staleness.eta", str(eta))
    train_tiny(tmp_path, "run", *flags, "--rollout.max-new-tokens", "48", *QUIET)
    rows = metrics_rows(tmp_path / "run")
    assert len(rows) == 4 and rows[-1]["pulls"] > 0  # the weights reached the instances ...
    assert all(r["interrupts"] == 0 for r in rows)  # ... with nothing interrupted: the in-flight update kept the KV
    assert all(r["bound_violations"] == 0 and r["staleness_max"] <= eta for r in rows)
    _check_audit(str(tmp_path / "run"), eta)
