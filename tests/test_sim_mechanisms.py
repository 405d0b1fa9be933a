"""The step-over-floor mechanisms of the simulated StaleFlow and what a real engine pays for them:
KV kept across an in-flight weight update (keep_kv_on_pull) and KV moved with a migrated trajectory
(kv_move_gb_s); each has an ablation that removes exactly it (sim/report.ABLATIONS)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from staleflow.config import CoordinatorConfig
from staleflow.coordinator.cost_model import load_cost_model
from staleflow.coordinator.types import Interrupt
from staleflow.sim import engine as sim_engine
from staleflow.sim.config import SimConfig
from staleflow.sim.hardware import MODEL_SPECS, derive, kv_bytes_per_token
from staleflow.sim.report import ABLATIONS
from staleflow.sim.simulator import build

sys.path.insert(0, str(Path(__file__).parent))
from sim_helpers import tiny_sim  # noqa: E402

COST = load_cost_model("qwen2.5-7b-tp1")
KV_BYTES = kv_bytes_per_token(MODEL_SPECS["qwen2.5-7b-tp1"])  # 57 KB a token: the tiny runs move 4000 tokens/s


def tiny(**kw) -> SimConfig:
    return tiny_sim(
        **{
            **dict(
                response_median=60.0,
                steps=10,
                kv_move_gb_s=4000 * KV_BYTES / 1e9,
                coordinator=CoordinatorConfig(
                    migration=True, psi=1.5, migration_stop=1, phi_wait=1, pull="greedy", keep_kv_on_pull=True
                ),
            ),
            **kw,
        }
    )


def drive(cfg, overrides=None):
    loop, backend, _ = build(cfg, "staleflow", 1, overrides)
    reasons, running_at_pull = [], []
    interrupt, pulls = backend.interrupt, [i.pull for i in backend.insts]

    def spy_interrupt(cmd: Interrupt):
        reasons.append(cmd.reason)
        interrupt(cmd)

    backend.interrupt = spy_interrupt
    for inst, pull in zip(backend.insts, pulls):

        def spy_pull(version, now, pull_s, inst=inst, pull=pull, **kw):
            running_at_pull.append(len(inst.running))
            pull(version, now, pull_s, **kw)

        inst.pull = spy_pull
    t = 0.0
    while not loop.done:
        t = loop.turn(t)
    return loop, backend, reasons, running_at_pull


def test_ablation_keep_kv_pulls_interrupt_nothing_and_keep_the_bound():
    loop, _, reasons, running = drive(tiny())
    assert loop.audit.violations == [] and len(loop.steps) == 10  # the bound is audited on every trained group
    assert "pull" not in reasons and sum(running) > 0  # weights loaded under running trajectories, none stopped
    # the ablation (what the peers do): every pull of a busy instance interrupts it, the work re-prefills
    loop, _, reasons, _ = drive(tiny(), {"keep_kv_on_pull": False})
    assert reasons.count("pull") > 0 and loop.audit.violations == []
    assert ("-keep kv (re-prefill after a pull)", "staleflow", {"keep_kv_on_pull": False}, {}) in ABLATIONS


def test_peers_never_keep_kv_across_a_weight_update():
    for mode in ("verl-fully-async", "areal", "verl-sync", "verl-one-step-off"):
        loop, _, _ = build(tiny(), mode, 1)
        assert loop.coord.cfg.keep_kv_on_pull is False  # they clear the KV cache at every update


def test_kv_move_charges_the_transfer_on_both_ends_and_only_reuses_valid_kv():
    def inst(rate, mixed=False, version=0):
        i = sim_engine.SimInstance(
            0, COST, prefill_tokens_per_s=1000.0, max_running=8, kv_move_tokens_per_s=rate, mixed_kv=mixed
        )
        i.version = version
        return i

    def admit(i, moved, kv_version):
        i.add(
            sim_engine.SimSequence(
                1, 0, prompt_len=100, target_len=5000, generated=1900, kv_moved=moved, kv_version=kv_version
            )
        )
        return i._admit()

    assert admit(inst(4000.0), 2000, 0) == pytest.approx(2000 / 4000)  # moved: transfer time, no prefill
    assert admit(inst(0.0), 2000, 0) == pytest.approx(2000 / 1000)  # no KV move: recomputed
    assert admit(inst(4000.0, version=1), 2000, 0) == pytest.approx(2000 / 1000)  # older weights' KV: recomputed
    assert admit(inst(4000.0, mixed=True, version=1), 2000, 0) == pytest.approx(0.5)  # ... unless keep-KV is on
    # the source pays the offload of every migrated RUNNING trajectory; a pull interrupt drops the KV
    loop, _, reasons, _ = drive(tiny())
    assert "migrate" in reasons and loop.coord.counters["migrations"] > 0
    spec = MODEL_SPECS["qwen2.5-32b-tp2"]
    hw = derive(SimConfig(), load_cost_model("qwen2.5-32b-tp2"))
    assert hw.kv_move_tokens_per_s == pytest.approx(16e9 / kv_bytes_per_token(spec))  # 262 KB a token: ~61k/s
    assert derive(SimConfig(kv_move_gb_s=0.0), load_cost_model("qwen2.5-32b-tp2")).kv_move_tokens_per_s == 0.0


def test_kv_move_source_stalls_for_the_offload():
    cfg = tiny()
    _, backend, _ = build(cfg, "staleflow", 1)
    src = backend.insts[0]
    src.add(sim_engine.SimSequence(7, 0, prompt_len=20, target_len=400))
    src.advance(0.5)  # admitted and decoding
    tokens = src.running[7].tok0 + src.step  # prompt + generated so far: its KV
    assert tokens > 20
    before = src.t
    backend.t = src.t
    backend.interrupt(Interrupt(0, (7,), "migrate"))
    moved, version = backend.kv_moved[7]
    assert moved == tokens and version == src.version
    assert src.t - before == pytest.approx(moved * src.speed / 4000.0) and src.kv_rate == pytest.approx(4000.0)
