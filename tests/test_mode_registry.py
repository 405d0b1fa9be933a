"""Modes as registered objects (staleflow.modes, docs/extending.md "A new peer baseline"): the registry and its
one-line errors, the --peer flag section composed from it, the simulator and the grid iterating it, and the
worked fork examples/bounded_queue_peer.py (one file) in the simulator, in the grid's peer search and for
two steps of a real run."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from staleflow.config import ConfigError, RunConfig, resolve
from staleflow.extensions import ExtensionError
from staleflow.modes import MODES, Mode, PeerSettings, apply_mode, mode_of, peers, protocol_for, register_mode
from staleflow.protocol import StalenessSpec

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ imports as it does from the repository root
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
PEER = "examples.bounded_queue_peer:BoundedQueue"


# ---- the registry ----------------------------------------------------------------------------------------
def test_mode_registry_holds_every_system_in_one_file_each():
    assert list(MODES) == [
        "staleflow",
        "staleflow-no-exchange",
        "staleflow-simple-strategies",
        "verl-sync",
        "verl-one-step-off",
        "verl-fully-async",
        "areal",
        "pipelinerl",
        "pipelinerl-reserve",
    ]
    files = {name: Path(sys.modules[cls.__module__].__file__).name for name, cls in MODES.items()}
    assert {files[m.name] for m in peers()} == {"verl.py", "areal.py", "pipelinerl.py"}  # rule, knobs, search together
    assert all(issubclass(cls, Mode) for cls in MODES.values())
    assert mode_of("sync") is mode_of("verl-sync") and mode_of("one-step-off").name == "verl-one-step-off"
    assert [f.name for f in dataclasses.fields(PeerSettings)] == ["verl_fully_async", "areal", "pipelinerl"]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("fastest", "--mode='fastest': choose one of staleflow, "),
        ("examples.nope:Peer", "cannot import module 'examples.nope'"),
        ("examples.bounded_queue_peer:Nope", "has no attribute 'Nope'"),
        ("examples.bounded_queue_peer:BoundedQueueBuffer", "class BoundedQueueBuffer"),
    ],
)
def test_mode_registry_an_unknown_or_broken_mode_is_one_line(spec, words):
    with pytest.raises((ConfigError, ExtensionError)) as e:
        resolve(RunConfig(mode=spec))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_mode_registry_a_registered_peer_is_one_class_and_one_line():
    """A mode registered in one place is a --mode everywhere: the run config, its protocol, the overrides."""

    @register_mode("test-fifo-peer")
    class FifoPeer(Mode):
        peer = "test"
        coordinator = {"routing": "least-loaded", "mlq": False}
        staleness = {"batch_redundancy": 0}

    try:
        cfg = resolve(RunConfig(mode="test-fifo-peer"))
        assert (cfg.coordinator.routing, cfg.coordinator.mlq) == ("least-loaded", False)
        assert "test-fifo-peer" in [m.name for m in peers()]
        assert type(protocol_for("test-fifo-peer", cfg.staleness)).__name__ == "StalenessManager"
        with pytest.raises(TypeError, match="Mode subclass"):
            MODES["broken"] = object  # the registry checks the interface when it takes an entry
    finally:
        del MODES["test-fifo-peer"]


def test_mode_registry_a_knob_belongs_to_its_own_mode():
    from staleflow.modes.areal import AReaLSettings

    other = PeerSettings(areal=AReaLSettings(max_concurrent_rollouts=4))
    with pytest.raises(ConfigError, match="--peer.areal.max-concurrent-rollouts=4 is a knob of --mode areal"):
        resolve(RunConfig(mode="verl-fully-async", peer=other))
    assert protocol_for("areal", RunConfig().staleness, peer=other).max_concurrent == 4
    with pytest.raises(ConfigError, match="mode 'areal' has no option staleness_threshold"):
        protocol_for("areal", RunConfig().staleness, peer={"staleness_threshold": 0.0})


# ---- the example peer: unit, simulator, grid, runtime ------------------------------------------------------
def test_mode_registry_example_peer_bounds_open_groups_and_trains_in_completion_order():
    from examples.bounded_queue_peer import BoundedQueueBuffer

    m = mode_of(PEER).protocol(StalenessSpec(eta=1, batch_size=2), mode_of(PEER).settings(), 1, "completion")
    assert isinstance(m, BoundedQueueBuffer) and m.max_groups == 4  # (eta + 1) B by default
    for g in range(4):
        assert m.can_admit(0)
        m.reserve(f"{g}.0", g, 0)
    assert not m.can_admit(0)  # K groups open
    for g in (2, 0, 1):
        m.complete(f"{g}.0")
        m.occupy(g)
    assert m.consume(0) == [2, 0] and m.open == 2 and m.can_admit(1)  # completion order; consuming frees places
    m.abort_group(3, "failed")
    assert m.open == 1
    m.validate()


def _sim(args: list[str], tmp_path: Path) -> tuple[dict, Counter]:
    calls = tmp_path / "calls.txt"
    os = __import__("os")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # the documented $PWD
    env = dict(os.environ, STALEFLOW_EXAMPLE_CALLS=str(calls), PYTHONPATH=path)
    res = subprocess.run(
        [sys.executable, "-m", "staleflow", "sim", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = calls.read_text().splitlines() if calls.exists() else []
    return json.loads(res.stdout.strip().splitlines()[-1]), Counter(line.split()[0] for line in lines)


def test_mode_registry_example_peer_runs_in_the_simulator_by_its_documented_command(tmp_path):
    from test_examples import documented

    (cmd,) = [c for c in documented("bounded_queue_peer.py") if " sim " in c]
    out, calls = _sim([*shlex.split(cmd)[5:], "--out-dir", str(tmp_path / "sim"), "--steps", "6"], tmp_path)
    assert out["violations"] == 0 and out["vs_sync"] > 0
    assert out["best_async"] == PEER  # the fastest asynchronous peer at that eta: the fork's, the only one here
    assert calls["BoundedQueueBuffer.admit"] > 0 and set(calls) == {"BoundedQueueBuffer.admit"}
    rows = json.loads((tmp_path / "sim" / "results.json").read_text())["runs"]
    assert {r["mode"] for r in rows} == {"verl-sync", "staleflow", PEER}


def test_mode_registry_example_peer_is_searched_in_the_grid(tmp_path, monkeypatch, capsys):
    """The grid's peer search iterates the peers among --modes: the fork's family (K = B .. 5 B) is scanned,
    its nominal and strict configurations fill their columns, and it can be the guarantee-matched best."""
    from sim_helpers import sim_config

    from staleflow.sim import grid, grid_settings

    monkeypatch.setattr(grid_settings, "MODELS", (("7B", "qwen2.5-7b-tp1", 1),))
    monkeypatch.setattr(grid_settings, "DISTS", ("lognormal",))
    monkeypatch.setattr(grid_settings, "SPLITS", ((3, 1),))
    for mod in (grid, grid_settings):
        monkeypatch.setattr(mod, "ETAS", (1,))
        monkeypatch.setattr(mod, "EXTRA", ())
        monkeypatch.setattr(mod, "CENTRE", ("7B lognormal 3:1", 1))
    cfg = sim_config(router_fit_samples=0, jobs=1, out_dir=str(tmp_path), modes=("verl-sync", "staleflow", PEER))
    assert grid.main(cfg) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["violations"] == 0 and summary["rows"] == 1
    saved = json.loads((tmp_path / "grid.json").read_text())
    labels = {r["config"] for r in saved["search"]["7B lognormal 3:1"]}
    assert "bounded-queue K=1B" in labels and "verl-sync" in labels
    assert not any(label.startswith(("areal", "verl-fully-async")) for label in labels)  # only the peers named
    (row,) = saved["settings"]
    assert set(row["nominal"]) == {"bounded-queue K=2B"} and row["strict_best"] == "bounded-queue K=2B strict"
    with pytest.raises(ConfigError, match="name at least one peer that has them"):
        grid.main(dataclasses.replace(cfg, modes=("verl-sync", "staleflow")))


def test_mode_registry_example_peer_command_is_the_documented_one():
    from test_examples import documented

    cmds = documented("bounded_queue_peer.py")
    assert cmds[0] == f"PYTHONPATH=$PWD ./launch.sh --preset tiny --mode {PEER}"
    guide = " ".join((ROOT / "docs" / "extending.md").read_text().replace("\\\n", " ").split())
    assert all(cmd in guide for cmd in cmds)


@pytest.mark.slow
def test_mode_registry_example_peer_trains_the_tiny_model(tmp_path):
    """The documented command, two steps: the controller built the fork's protocol, which admitted the
    groups the trainer trained, and the run kept to the peer's own rule (it reports trained groups beyond eta)."""
    from test_examples import STEPS, _launch

    rows, calls = _launch("bounded_queue_peer.py", tmp_path)
    admitted = Counter(name for name, _ in calls.elements())
    assert set(admitted) == {"BoundedQueueBuffer.admit"} and len({pid for _, pid in calls}) == 1  # the controller
    trained = sum(r["trained_groups"] for r in rows)
    assert [r["step"] for r in rows] == list(range(STEPS)) and 0 < trained <= admitted["BoundedQueueBuffer.admit"]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["mode"] == PEER and apply_mode(PEER, RunConfig().coordinator)[0].routing == "least-loaded"
