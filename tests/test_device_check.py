"""scripts/device_check_steps.py on CPU: the same code paths as its GPU steps (gloo instead of NCCL,
chunked vs naive log-probs instead of Triton vs chunked, shared-memory slots instead of CUDA IPC
pieces), so the prepared device check does not rot between GPU sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.scripts_smoke]  # a row of tests/test_scripts_smoke.py
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check_steps.py"


@pytest.mark.parametrize("step", ["trainer", "ps"])
def test_device_check_step_runs_on_cpu(step):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), step, "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env
    )
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and res["ok"] is True, proc.stdout[-2000:] + proc.stderr[-2000:]
    if step == "trainer":
        assert res["chunked"]["fsdp2_sharded"] and res["loss_rel_diff"] < 1e-6
    else:
        assert [p["exact"] for p in res["pulls"]] == [True] * 4 and {p["reader"] for p in res["pulls"]} == {2, 3}


def _dry_run(tmp_path, **env_extra) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
        **env_extra,
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT.parent / "device_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=900,  # ~30 s idle; minutes on a loaded 2-core machine (it imports torch per step)
        cwd=tmp_path,
        env=env,
    )
    return proc, out


def test_device_check_dry_run_validates_one_call_of_both_parts_within_570_s(tmp_path):
    """The plan is ONE call of the run tool (timeout_s 600): both parts, their limits summing to <= 570 s."""
    import re
    import tarfile

    proc, out = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    calls: dict[str, list] = {}
    current = None
    for line in proc.stdout.splitlines():
        m = re.match(r"^part (\w+)$", line)
        if m:
            current = calls.setdefault(m.group(1), [])
        m = re.match(r"^step (\d+) (\w+): limit (\d+) s: (.*)$", line)
        if m:
            current.append(m.groups())
    assert list(calls) == ["correctness", "benchmark"]
    names = {c: [s[1] for s in steps] for c, steps in calls.items()}
    assert names == {
        "correctness": ["env", "ps_ipc", "torchrun_2proc", "engine_gpu", "kernel_tests", "decode_graphs"],
        "benchmark": ["kernel_bench", "engine_7b", "trainer_7b"],
    }
    total = sum(int(s[2]) for steps in calls.values() for s in steps)
    assert total <= 570
    assert (
        f"plan: one call of the run tool (timeout_s 600, kind nvidia-h100-x1) runs both parts; the step limits "
        f"sum to {total} s (at most 570)" in proc.stdout
    )
    limits = {s[1]: int(s[2]) for steps in calls.values() for s in steps}
    assert limits["kernel_tests"] >= 100 and limits["engine_gpu"] >= 45  # room for their cold Triton compiles
    commands = {s[1]: s[3] for steps in calls.values() for s in steps}
    assert "tests/test_decode_device.py" in commands["decode_graphs"]  # the graph replay test runs on the device
    assert "--shapes 16384x3584x152064" in commands["kernel_bench"] and "chunked-train" in commands["kernel_bench"]
    assert "gather+graphs" not in commands["engine_7b"]
    # step 8 then writes the cost samples fit_cost_model.py refits a profile from; the dry run validates its cells
    assert commands["engine_7b"].endswith(f"--cost-samples {out}/cost_samples.jsonl")
    assert "validated engine_7b: 4 configuration(s): triton, triton+graphs, gather, cost-samples 7 cells" in proc.stdout
    # every step validated, and the dry run says so
    assert proc.stdout.count("  validated ") == 9 and "INVALID" not in proc.stdout
    assert "configurations validated" in proc.stdout
    # never a bare `python`: the interpreter it was started with
    assert not re.search(r"(^|[\s:])python ", commands["env"]) and commands["env"].startswith(sys.executable)
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "device_check_benchmark.json",
        "device_check_benchmark_logs.tar.gz",
        "device_check_correctness.json",
        "device_check_correctness_logs.tar.gz",
    ]
    for call, steps in calls.items():
        summary = json.loads((out / f"device_check_{call}.json").read_text())
        assert summary["dry_run"] is True and summary["limit_total_s"] == sum(int(s[2]) for s in steps)
        with tarfile.open(out / f"device_check_{call}_logs.tar.gz") as tar:
            assert {Path(n).name for n in tar.getnames()} >= {f"{s[1]}.log" for s in steps}


def test_device_check_dry_run_fails_on_the_old_step_7_matrix(tmp_path):
    """The matrix step 7 used to build (every backend with CUDA graphs off and on) includes graphs on
    gather, which check_cuda_graphs refuses on the device: the dry run (scripts/device_check_validate.py
    on the step's exact command) must fail on it, naming why."""
    proc, _ = _dry_run(tmp_path, STEPS="8", ENGINE_CONFIGS="triton,triton+graphs,gather,gather+graphs")
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "INVALID engine_7b: gather+graphs: --rollout.cuda-graphs needs the triton or flash decode backend" in (
        proc.stdout
    )
    assert "configuration validation FAILED" in proc.stderr


def test_device_check_script_calls_no_bare_python():
    import re

    for name in ("device_check.sh", "device_check_prepare.sh"):
        text = (SCRIPT.parent / name).read_text()
        code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        assert not re.search(r"(^|[\s;|&(])python\s", code), name


def test_device_check_engine_configs_are_validated_by_check_cuda_graphs():
    res = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "bench_engine_shape.py"), "--validate", "--device", "cuda",
         "--configs", "triton,triton+graphs,gather,gather+graphs,mirror"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 2 and out["ok"] is False
    assert [e.split(":")[0] for e in out["errors"]] == ["gather+graphs", "mirror"]


def test_device_check_run_kills_a_timed_out_tree_with_a_setsid_grandchild(tmp_path):
    """scripts/device_check_run.py: a step whose grandchild left the step's session (setsid, as
    torchrun's workers do) and which runs past its limit leaves no process behind."""
    prog = tmp_path / "tree.py"
    prog.write_text(
        "import os, subprocess, sys, time\n"
        "role, pidfile = sys.argv[1], sys.argv[2]\n"
        "if role == 'grandchild':\n"
        "    os.setsid()\n"
        "    open(pidfile, 'w').write(str(os.getpid()))\n"
        "else:\n"
        "    subprocess.Popen([sys.executable, __file__, 'child' if role == 'parent' else 'grandchild', pidfile])\n"
        "time.sleep(120)\n"
    )
    pidfile = tmp_path / "grandchild.pid"
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import device_check_run as dcr
    finally:
        sys.path.pop(0)
    marker_seen = []
    orig = dcr.kill_step

    def spy(root, marker, grace_s=3.0):
        import time

        for _ in range(100):  # the grandchild is up before the limit (it writes its pid first)
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.05)
        marker_seen.append(marker)
        return orig(root, marker, grace_s)

    dcr.kill_step = spy
    try:
        res = dcr.run_step([sys.executable, str(prog), "parent", str(pidfile)], 3.0, str(tmp_path / "step.log"))
    finally:
        dcr.kill_step = orig
    assert res["timed_out"] and res["rc"] == 124 and res["left"] == 0 and res["killed"] >= 3
    gpid = int(pidfile.read_text())
    stat = Path(f"/proc/{gpid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # gone (or a zombie)
    assert dcr.step_processes(0, marker_seen[0], set()) == set()  # nothing carries the step's marker
    assert "ran past its limit" in (tmp_path / "step.log").read_text()


def test_device_check_env_detects_gvisor_from_dmesg_or_proc_version():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from device_check_steps import kernel_info
    finally:
        sys.path.pop(0)
    assert kernel_info("Linux version 6.18.0 (gcc) #1 SMP", "[0.0] Linux")["sandbox"] is None
    assert kernel_info("Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016", "")["sandbox"] == "gvisor"
    assert kernel_info("Linux version 4.4.0", "[   0.000000] Starting gVisor...")["sandbox"] == "gvisor"
    assert kernel_info("", "")["kernel"]  # uname -r is always recorded


def test_device_check_env_step_records_versions_and_out_dtype_support():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "env", "--device", "cpu"], capture_output=True, text=True, timeout=120
    )
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and res["ok"] is True, proc.stderr[-2000:]
    import torch

    assert res["torch"] == torch.__version__ and set(res["dev_shm_gib"]) == {"total", "free"}
    assert res["mm_out_dtype"] is True or res["mm_out_dtype"].startswith("no (")


def _script_json(name: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / name), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_device_check_engine_shape_bench_runs_small_on_cpu():
    res = _script_json(
        "bench_engine_shape.py", "--device", "cpu", "--hidden", "64", "--layers", "2", "--batch", "4", "--prompt", "16",
        "--new-tokens", "8",
    )  # fmt: skip
    assert res["ok"] is True and [r["backend"] for r in res["runs"]] == ["gather", "mirror"]
    assert all(r["decode_tok_s"] > 0 and r["agree_with_base"] == 1.0 for r in res["runs"])  # fp32: identical tokens
    assert res["runs"][0]["tok_s_vs_base"] == 1.0 and res["plan_gib"] > 0
    assert res["configs"] == ["gather", "mirror"] and res["runs"][0]["cuda_graphs"] is False


def test_device_check_trainer_shape_bench_runs_small_on_cpu():
    res = _script_json(
        "bench_trainer_shape.py", "--device", "cpu", "--hidden", "64", "--layers", "2", "--micro-batch-tokens", "64",
        "--len", "16", "--samples", "8", "--steps", "2",
    )  # fmt: skip
    assert res["ok"] is True and res["tokens_per_step"] == 8 * 32 and res["tokens_per_s"] > 0
    assert res["shape"]["layers"] == 2 and res["plan_gib"] > 0 and "optim_step" in res["plan_items_gib"]


def test_device_check_ipc_steps_skip_under_gvisor_with_one_line(tmp_path):
    """Step 1 records the kernel and detects gVisor (here from a faked dmesg on PATH); the CUDA IPC
    step is then skipped with its reason instead of failing."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dmesg").write_text("#!/bin/sh\necho '[    0.000000] Starting gVisor...'\n")
    (fake / "dmesg").chmod(0o755)
    env = {
        **os.environ,
        "STEPS": "1 2",
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "PATH": os.pathsep.join((str(fake), str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT.parent / "device_check.sh"), "correctness"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "device_check_correctness.json").read_text())
    env_step, ipc = summary["steps"]
    assert env_step["status"] == "pass" and env_step["detail"]["sandbox"] == "gvisor" and env_step["detail"]["kernel"]
    assert ipc["name"] == "ps_ipc" and ipc["status"] == "skipped"
    assert ipc["detail"]["skipped"].startswith("CUDA IPC may be refused under gvisor (kernel ")
    assert "ps_ipc skipped: CUDA IPC may be refused under gvisor" in proc.stdout
    # the summary says what was not covered, and why, and where to run it
    assert summary["ok"] is True and summary["complete"] is False and list(summary["skipped"]) == ["ps_ipc"]
    assert "NOT COVERED: ps_ipc: skipped: CUDA IPC may be refused under gvisor" in proc.stdout
    assert "NOT COVERED: CUDA IPC" in proc.stdout and "nvidia-h100-x1" in proc.stdout
    assert "part correctness: ok, but 1 step(s) skipped" in proc.stdout


def test_device_check_steps_needing_msgspec_are_skipped_with_the_fix_without_it(tmp_path):
    """The GPU image has no msgspec: steps 2 and 9 (like 3) are gated on the carried wheels and skipped
    with the fix named, not run into an ImportError that reads as a failed step."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoMsgspec:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'msgspec':\n"
        "            raise ImportError('no msgspec here (the GPU image)')\n"
        "sys.meta_path.insert(0, _NoMsgspec())\n"
    )
    env = {
        **os.environ,
        "STEPS": "2 3 9",
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
        "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT.parent / "device_check.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    correctness = json.loads((tmp_path / "out" / "device_check_correctness.json").read_text())
    benchmark = json.loads((tmp_path / "out" / "device_check_benchmark.json").read_text())
    skipped = {**correctness["skipped"], **benchmark["skipped"]}
    assert list(skipped) == ["ps_ipc", "torchrun_2proc", "trainer_7b"]
    assert all("msgspec" in why and "device_check_prepare.sh" in why for why in skipped.values())
    for name in skipped:
        assert f"NOT COVERED: {name}: skipped: needs " in proc.stdout


def test_device_check_waits_end_with_the_child_exit_code_inside_the_step_limit():
    """A child that dies makes the step report its exit code at once; a silent child ends the wait at
    the deadline the runner sets a few seconds before the step's limit (never a bare timeout)."""
    import multiprocessing as mp
    import time

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from device_check_steps import wait_for
    finally:
        sys.path.pop(0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    dead = ctx.Process(target=sys.exit, args=(3,))
    dead.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"waiting for the owner's start: the piece owner exited with code 3"):
        wait_for(q, {"piece owner": dead}, time.time() + 60, "the owner's start")
    assert time.monotonic() - t0 < 30
    silent = ctx.Process(target=time.sleep, args=(30,))
    silent.start()
    try:
        with pytest.raises(RuntimeError, match=r"nothing before this step's limit \(reader 2 running\)"):
            wait_for(q, {"reader 2": silent}, time.time() + 1.0, "the pulls of version 1")
    finally:
        silent.kill()
        silent.join()
    q.put(("pulled", 2))
    assert wait_for(q, {"reader 2": silent}, time.time() + 5, "x") == ("pulled", 2)  # a message still wins


def test_device_check_ipc_steps_run_outside_a_sandbox(tmp_path):
    """No sandbox (a plain dmesg, as on the H100's Firecracker VM): the CUDA IPC step must RUN. An
    empty sandbox field once shifted the kernel into SANDBOX (whitespace IFS), skipping it everywhere."""
    sys.path.insert(0, str(SCRIPT.parent))
    from device_check_steps import kernel_info

    if kernel_info(dmesg="")["sandbox"]:
        pytest.skip("this machine's /proc/version is gVisor's")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dmesg").write_text("#!/bin/sh\necho '[    0.000000] Linux version 6.18.44'\n")
    (fake / "dmesg").chmod(0o755)
    env = {
        **os.environ,
        "STEPS": "1 2",
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "PATH": os.pathsep.join((str(fake), str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT.parent / "device_check.sh"), "correctness"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    summary = json.loads((tmp_path / "out" / "device_check_correctness.json").read_text())
    env_step, ipc = summary["steps"]
    assert env_step["status"] == "pass" and env_step["detail"]["sandbox"] is None, proc.stdout[-2000:]
    assert ipc["name"] == "ps_ipc" and ipc["status"] != "skipped", proc.stdout[-2000:]
    assert "== step 2: ps_ipc (limit" in proc.stdout and "skipped" not in proc.stdout


def _dcr():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import device_check_run
    finally:
        sys.path.pop(0)
    return device_check_run


def test_device_check_run_never_widens_the_kill_to_its_own_session():
    """A root pid that (reused) belongs to a process of the driver's own session must not pull that
    whole session, the driver's shell and its siblings, into the step's kill list."""
    dcr = _dcr()
    a = subprocess.Popen(["sleep", "30"])  # this test's session, as device_check.sh's own helpers are
    b = subprocess.Popen(["sleep", "30"])
    try:
        found = dcr.step_processes(a.pid, "no-such-marker", set())
        assert found == {a.pid}, found
        assert os.getppid() not in found and b.pid not in found
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_device_check_run_treats_a_failing_nvidia_smi_as_no_check(tmp_path, monkeypatch):
    """nvidia-smi that cannot reach NVML (a sandbox) prints its error on stdout and exits non-zero:
    that is "no check" (None), not a busy GPU waited on after every step."""
    dcr = _dcr()
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'Failed to initialize NVML: Unknown Error'\nexit 9\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert dcr.gpu_free(0.5) is None
    fake.write_text("#!/bin/sh\necho 4242\n")  # a compute process that stays: busy
    assert dcr.gpu_free(0.2) is False
    fake.write_text("#!/bin/sh\nexit 0\n")
    assert dcr.gpu_free(0.2) is True


def test_device_check_call_stopped_midway_still_returns_the_finished_steps(tmp_path):
    """The run tool stops a call at its timeout_s (killing device_check.sh): the steps finished by
    then are already in $OUT (device_check_<call>.json marked partial, and the logs)."""
    import signal
    import time

    real = sys.executable
    pidfile = tmp_path / "slow.pid"
    wrapper = tmp_path / "py"
    wrapper.write_text(  # the ps step hangs (as a step running past the call's timeout would)
        f'#!/bin/sh\ncase "$*" in *"device_check_steps.py ps"*) echo $$ > {pidfile}; exec sleep 60 ;; esac\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "STEPS": "1 2", "OUT": str(out), "PYTHON": str(wrapper), "STALEFLOW_DEVCHECK_IPC": "1"}
    env["PATH"] = os.pathsep.join((str(Path(real).parent), os.environ.get("PATH", "")))
    proc = subprocess.Popen(
        ["bash", str(SCRIPT.parent / "device_check.sh"), "correctness"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(1200):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # the run tool's timeout
        proc.wait()
    finally:
        if pidfile.exists() and pidfile.read_text().strip():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    summary = json.loads((out / "device_check_correctness.json").read_text())
    assert summary["partial"] is True and [s["name"] for s in summary["steps"]] == ["env"], summary
    assert summary["steps"][0]["status"] == "pass" and (out / "device_check_correctness_logs.tar.gz").exists()


def test_device_check_counts_one_cubin_per_triton_compile(tmp_path):
    """Each step's triton_compiles is the number of .cubin files its run added to the call's own Triton
    cache: one per compiled kernel. Checked with the offline sm_90 compile of the 3 log-prob kernels."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("triton wheel without the bundled NVIDIA tools")
    root = SCRIPT.parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(root / "tests" / "test_kernels_compile.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(list(tmp_path.rglob("*.cubin"))) == len(compiled) == 3
    script = (root / "scripts" / "device_check.sh").read_text()
    assert "compiles() { find \"$TRITON_CACHE_DIR\" -name '*.cubin'" in script  # the same count
