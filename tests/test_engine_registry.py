"""Rollout engines as registered backends (staleflow.engines, docs/extending.md): the registry's
look-ups and one-line errors, the --rollout.engine flag through `staleflow check`, no engine name
tested outside its backend, and the worked fork examples/lockstep_engine.py, unit and end to end."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import tokenize
from collections import Counter
from pathlib import Path

import pytest

from staleflow.config import ConfigError, ModelConfig, RolloutConfig, RunConfig
from staleflow.engines import ENGINES, EngineBackend, engine_backend
from staleflow.engines.builtin import BuiltinBackend
from staleflow.engines.vllm import VllmBackend
from staleflow.extensions import ExtensionError

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ imports as it does from the repository root
    sys.path.insert(0, str(ROOT))
LOCKSTEP = "examples.lockstep_engine:LockstepBackend"


def _cfg(engine: str, **rollout) -> RunConfig:
    return RunConfig(rollout=RolloutConfig(engine=engine, **rollout))


# ---- the registry ----------------------------------------------------------------------------------
def test_engine_registry_holds_the_builtins_and_resolves_names_and_paths():
    assert set(ENGINES) >= {"builtin", "vllm"}
    assert type(engine_backend(RunConfig())) is BuiltinBackend  # the default
    vllm = engine_backend(_cfg("vllm"))
    assert type(vllm) is VllmBackend and not vllm.rank_loads_model and vllm.takes_gpu_share
    assert [m for m, _ in vllm.extras] == ["vllm"]
    from examples.lockstep_engine import LockstepBackend

    fork = engine_backend(_cfg(LOCKSTEP))
    assert type(fork) is LockstepBackend and fork.rank_loads_model and not fork.takes_gpu_share


class _NoBuild:
    rank_loads_model, takes_gpu_share, extras = True, False, ()

    def __init__(self, cfg):
        pass

    def weight_source(self, run_id, reader, worker_reader): ...

    def check_placement(self, topology): ...

    def plan_rank(self, site): ...


class _Raises(EngineBackend):
    def __init__(self, cfg):
        raise RuntimeError("no accelerator\nhere")

    def build(self, ctx, model, gpu_share): ...


def _tiny_backend_fn(cfg): ...


@pytest.mark.parametrize(
    "spec, says",
    [
        ("fast", "--rollout.engine='fast' is not a registered rollout engine (builtin, vllm) nor an import path"),
        ("no_such_fork.engine:Fast", "cannot import module 'no_such_fork.engine'"),
        ("examples.lockstep_engine:Nope", "module 'examples.lockstep_engine' has no attribute 'Nope'"),
        (f"{__name__}:_tiny_backend_fn", "is function _tiny_backend_fn(cfg), not a class"),
        (f"{__name__}:_NoBuild", "class _NoBuild without a method build()"),
        (f"{__name__}:_Raises", "_Raises(cfg) failed (RuntimeError: no accelerator here)"),
    ],
)
def test_engine_registry_a_bad_spec_is_one_line_naming_the_flag(spec, says):
    with pytest.raises(ExtensionError) as e:
        engine_backend(_cfg(spec))
    text = str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in text and says in text
    assert text.startswith(f"--rollout.engine={spec!r}") and "a rollout engine is class (cfg) with build(" in text


def test_engine_registry_flag_parses_any_spec_and_check_refuses_a_bad_one(tmp_path, capsys):
    from staleflow.config.parse import parse
    from staleflow.launch import check
    from staleflow.presets import PRESETS

    cfg = parse(
        RunConfig,
        ["--preset", "tiny", "--rollout.engine", LOCKSTEP],
        PRESETS,
        default="smollm2-cpu",
        prog="staleflow train",
    )
    assert cfg.rollout.engine == LOCKSTEP
    code = check.main(["--preset", "tiny", "--log.run-dir", str(tmp_path), "--rollout.engine", "my_fork.engine:Fast"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1 and "--rollout.engine='my_fork.engine:Fast': cannot import module" in err[0]
    assert check.main(["--preset", "tiny", "--log.run-dir", str(tmp_path), "--rollout.engine", LOCKSTEP]) == 0


def test_engine_registry_placement_and_plan_come_from_the_backend():
    from staleflow.cluster.roles import Roles
    from staleflow.cluster.topology import Topology
    from staleflow.plan import build_plan
    from staleflow.presets import preset_gpu_7b

    two_nodes = Topology.from_ranks(Roles(4, 2), [0, 0, 1, 1], [0, 1, 0, 1], {0: "127.0.0.1", 1: "127.0.0.1"})
    two_nodes.validate(engine_backend(_cfg(LOCKSTEP)))  # the fork inherits "every layout"
    with pytest.raises(ConfigError, match=r"--rollout.engine=vllm on rollout ranks \[2, 3\]"):
        two_nodes.validate(engine_backend(_cfg("vllm")))
    gpu = preset_gpu_7b()

    def plan(engine: str):
        cfg = dataclasses.replace(gpu, rollout=dataclasses.replace(gpu.rollout, engine=engine))
        return build_plan(cfg, nproc=8, gpu_bytes=80 << 30, flash=False)

    builtin, fork, vllm = plan("builtin"), plan(LOCKSTEP), plan("vllm")
    assert [r.items for r in fork.ranks] == [r.items for r in builtin.ranks] and fork.gpu_share == {}
    assert sorted(vllm.gpu_share) == [4, 5, 6, 7] and all(0 < s < 1 for s in vllm.gpu_share.values())
    assert vllm.ranks[4].items["contexts"] == 2 * builtin.ranks[4].items["contexts"]  # the engine's own process


def test_engine_registry_the_vllm_backend_imports_without_vllm():
    """CI has no vLLM: resolving the backend, its extras and its memory plan import none of it."""
    code = (
        "import sys; from staleflow.config import RunConfig, RolloutConfig; from staleflow.plan import build_plan\n"
        "from staleflow.engines import engine_backend\n"
        "cfg = RunConfig(model=__import__('staleflow.config', fromlist=['ModelConfig']).ModelConfig(path='tiny-llama'),"
        " rollout=RolloutConfig(engine='vllm'))\n"
        "b = engine_backend(cfg); p = build_plan(cfg, nproc=3, gpu_bytes=0, device_type='cpu')\n"
        "print(sorted(p.ranks[1].items), 'vllm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "False" and "kv_cache" in " ".join(out)


# ---- no engine name tested outside its backend ------------------------------------------------------
WIRING = ("workers", "servers", "cluster", "launch", "plan", "config")


def _code_mentions(path: Path) -> list[str]:
    """Identifiers and string literals (not docstrings, not comments) of a file that name vLLM."""
    found, prev = [], None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING) and "vllm" in tok.string.lower():
            docstring = tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.NEWLINE, None)
            if not docstring:
                found.append(f"{path.name}:{tok.start[0]}: {tok.line.strip()}")
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    return found


def test_engine_registry_no_engine_name_outside_its_backend():
    """The run's wiring (workers, servers, cluster, launch, plan, config) names no engine in code:
    every engine-specific choice is its backend's (engines/)."""
    pkg = ROOT / "src" / "staleflow"
    found = [m for part in WIRING for f in sorted((pkg / part).rglob("*.py")) for m in _code_mentions(f)]
    assert found == []


def test_engine_registry_the_name_check_sees_code(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text('"""Docs may say vLLM."""\n# so may comments: vllm\nif engine == "vllm":\n    import vllm_x\n')
    assert [m.split(": ", 1)[1] for m in _code_mentions(f)] == ['if engine == "vllm":', "import vllm_x"]


# ---- the worked fork: static batching --------------------------------------------------------------
def _engines(batch: int):
    from examples.lockstep_engine import LockstepEngine
    from staleflow.rollout.builtin_engine import BuiltinEngine

    rc = RolloutConfig(max_running=8, max_new_tokens=10, max_model_len=64)
    make = lambda: BuiltinEngine.from_config(ModelConfig(path="tiny-llama"), rc, device="cpu")  # noqa: E731
    return LockstepEngine(make(), batch=batch), make()


def _requests(n: int, temperature: float = 0.0):
    from staleflow.rollout.engine import Request, SamplingParams

    p = SamplingParams(temperature=temperature, max_new_tokens=6, seed=11, ignore_eos=True)
    return [Request(i, [1, 5 + i, 7, 9 + 2 * i][: 2 + i % 3], p) for i in range(n)]


def test_engine_registry_lockstep_admits_a_batch_only_when_the_last_one_finished():
    lock, _ = _engines(batch=2)
    for r in _requests(5):
        lock.add(r)
    s = lock.stats()
    assert (s.num_running, s.num_waiting, sorted(s.waiting_ids)) == (0, 5, [0, 1, 2, 3, 4])
    running_sets, outs = [], []
    while lock.has_unfinished():
        outs += lock.step()
        running_sets.append(frozenset(lock.stats().running_ids))
    batches = [b for i, b in enumerate(running_sets) if b and (i == 0 or not running_sets[i - 1] >= b)]
    assert [sorted(b) for b in batches] == [[0, 1], [2, 3], [4]]  # never topped up mid-batch
    assert sorted(o.request_id for o in outs) == [0, 1, 2, 3, 4]
    assert all(
        len(o.tokens.response_ids) == len(o.tokens.behaviour_logprobs) == len(o.tokens.versions) == 6 for o in outs
    )
    assert all(lp <= 0 for o in outs for lp in o.tokens.behaviour_logprobs)
    assert {v for o in outs for v in o.tokens.versions} == {0}


def test_engine_registry_lockstep_samples_what_the_builtin_engine_samples():
    from staleflow.rollout.engine import EngineError, generate_all

    lock, plain = _engines(batch=3)
    want = generate_all(plain, _requests(5))
    got = {o.request_id: o for o in generate_all(lock, _requests(5))}
    assert [got[w.request_id].tokens.response_ids for w in want] == [w.tokens.response_ids for w in want]  # greedy
    assert all(
        got[w.request_id].tokens.behaviour_logprobs == pytest.approx(w.tokens.behaviour_logprobs, abs=1e-4)
        for w in want
    )
    first = _requests(1)[0]
    lock.add(first)
    with pytest.raises(EngineError, match="already in the engine"):
        lock.add(first)
    (aborted,) = lock.abort([first.request_id])  # held, never stepped: comes back as it went in
    assert aborted.finish_reason == "abort" and aborted.tokens.response_ids == [] and not lock.has_unfinished()


def test_engine_registry_lockstep_command_is_the_documented_one():
    from test_examples import documented

    (cmd,) = documented("lockstep_engine.py")
    guide = " ".join((ROOT / "docs" / "extending.md").read_text().split())
    assert cmd == f"PYTHONPATH=$PWD ./launch.sh --preset tiny --rollout.engine {LOCKSTEP}" and cmd in guide


@pytest.mark.slow
def test_engine_registry_lockstep_trains_the_tiny_model(tmp_path):
    """The documented command, two steps: each rollout rank built the fork's engine, which admitted
    batches, and the run trained on what it sampled."""
    from test_examples import STEPS, _launch

    rows, calls = _launch("lockstep_engine.py", tmp_path)
    by_name = Counter(name for name, _ in calls.elements())
    builds = {pid for name, pid in calls if name == "LockstepBackend.build"}
    ranks = json.loads((tmp_path / "run" / "config.json").read_text())["rollout"]["ranks"]
    assert len(builds) == ranks and by_name["LockstepEngine.admit"] >= 1, calls
    assert [r["step"] for r in rows] == list(range(STEPS)) and sum(r["trained_groups"] for r in rows) > 0
