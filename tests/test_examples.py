"""The worked forks in examples/ (docs/extending.md): each runs end to end by the very command its
docstring and docs/extending.md show (on the tiny preset, shortened to 2 steps; the routing
strategy also in the simulator), and it is the fork's code that runs there, not a built-in: each
example appends a line per call to $STALEFLOW_EXAMPLE_CALLS (examples/calls.py), counted here
against what the run reports. Plus what each example computes, against a reference."""

from __future__ import annotations

import ast
import json
import math
import os
import shlex
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.protocol import StalenessSpec
from staleflow.train.advantages import compute_advantages
from staleflow.train.losses import LossInputs, LossSettings, policy_loss, token_weights

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # as the documented `PYTHONPATH=$PWD ./launch.sh` from the root has it
    sys.path.insert(0, str(ROOT))
PREFIX = "PYTHONPATH=$PWD "
"""Every example command names the checkout on the import path: no StaleFlow process puts the working
directory there itself (launch/import_path.py)."""
STEPS = 2
SHORT = [
    "--steps",
    str(STEPS),
    "--log.no-progress",
    "--log.no-plot",
    "--log.name",
    "run",
    "--reward.fn",
    "e2e_rewards:text_length",
]  # a reward that varies within a group on a random model


def documented(example: str) -> list[str]:
    """The commands an example's docstring shows (PYTHONPATH=$PWD ./launch.sh ... and ... python -m staleflow sim)."""
    doc = ast.get_docstring(ast.parse((ROOT / "examples" / example).read_text())).replace("\\\n", " ")
    lines = [" ".join(line.split()) for line in doc.splitlines()]
    return [line for line in lines if line.startswith((PREFIX + "./launch.sh", PREFIX + "python -m"))]


@pytest.mark.parametrize("example", ["cispo.py", "rank_advantage.py", "kv_router.py"])
def test_examples_commands_are_the_documented_ones(example):
    cmds = documented(example)
    assert cmds and all(cmd.startswith(PREFIX + "./launch.sh --preset tiny ") or "sim" in cmd for cmd in cmds)
    guide = " ".join((ROOT / "docs" / "extending.md").read_text().replace("\\\n", " ").split())
    assert all(cmd in guide for cmd in cmds), f"docs/extending.md must show {cmds}"


def _env(calls: Path) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")) if p)  # $PWD: ROOT
    return dict(os.environ, PYTHONPATH=path, STALEFLOW_EXAMPLE_CALLS=str(calls))


def _run(cmd: list[str], calls: Path, timeout: float = 540) -> str:
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(calls),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{shlex.join(cmd)} ran over {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{shlex.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}"
    return out


def _launch(example: str, tmp_path: Path) -> tuple[list[dict], Counter]:
    """Run the example's ./launch.sh command for STEPS steps: (metrics rows, calls by name and pid)."""
    (cmd,) = [c for c in documented(example) if c.startswith(PREFIX + "./launch.sh")]
    calls = tmp_path / "calls.txt"
    _run(["bash", str(ROOT / "launch.sh"), *shlex.split(cmd)[2:], *SHORT, "--log.run-dir", str(tmp_path)], calls)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows] == list(range(STEPS))
    lines = calls.read_text().splitlines() if calls.exists() else []
    return rows, Counter(tuple(line.split()) for line in lines)


# ---- end to end: the runtime and the simulator ------------------------------------------------------
@pytest.mark.slow
def test_examples_cispo_loss_trains_the_tiny_model(tmp_path):
    rows, calls = _launch("cispo.py", tmp_path)
    by_name = Counter(name for name, _ in calls.elements())
    assert set(by_name) == {"cispo_loss"} and by_name["cispo_loss"] >= STEPS, calls  # >= one micro-batch a step
    assert any(r["train"]["grad_norm"] > 0 for r in rows)  # its loss had a gradient


@pytest.mark.slow
def test_examples_rank_advantage_scores_every_group(tmp_path):
    rows, calls = _launch("rank_advantage.py", tmp_path)
    groups, ranks = sum(r["trained_groups"] for r in rows), len({pid for _, pid in calls})
    assert Counter(name for name, _ in calls.elements()) == Counter({"centered_rank": groups * ranks})  # each group,
    # on every trainer rank (each computes the advantages of the whole step)
    assert all(0 < r["train"]["advantage_abs_mean"] <= 0.5 for r in rows)  # centred ranks lie in [-1/2, 1/2]


@pytest.mark.slow
def test_examples_kv_router_routes_the_runtime(tmp_path):
    rows, calls = _launch("kv_router.py", tmp_path)
    routed = max(r["routes"] for r in rows)  # cumulative count of Route commands
    assert routed > 0 and sum(calls.values()) >= routed  # every route went through MostFreeKV.choose
    assert {name for name, _ in calls} == {"MostFreeKV.choose"} and len({pid for _, pid in calls}) == 1  # controller


def test_examples_kv_router_routes_the_simulator(tmp_path):
    (cmd,) = [c for c in documented("kv_router.py") if " sim " in c]
    calls = tmp_path / "calls.txt"
    out = _run(
        [
            sys.executable,
            *shlex.split(cmd)[2:],  # PYTHONPATH=$PWD python ...: _env names ROOT
            "--out-dir",
            str(tmp_path / "sim"),
            "--steps",
            "6",
            "--warmup-steps",
            "1",
        ],
        calls,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["violations"] == 0
    chosen = Counter(line.split()[0] for line in calls.read_text().splitlines())
    assert chosen["MostFreeKV.choose"] > 0 and set(chosen) == {"MostFreeKV.choose"}


# ---- what each example computes ------------------------------------------------------------------
def _inputs(adv: list[float], ratio: list[float]) -> LossInputs:
    n = len(adv)
    logp = torch.full((n,), -1.0, dtype=torch.float64).requires_grad_()
    old = logp.detach() - torch.log(torch.tensor(ratio, dtype=torch.float64))  # exp(logp - old) = ratio
    seq = torch.arange(n)
    return LossInputs(
        logp=logp,
        behaviour_logp=old,
        proximal_logp=logp.detach().clone(),
        advantages=torch.tensor(adv, dtype=torch.float64),
        token_weight=torch.tensor(token_weights("token-mean", [1] * n), dtype=torch.float64),
        seq_index=seq,
        num_seqs=n,
    )


def test_examples_cispo_gradient_is_the_clipped_weight_times_the_advantage():
    """d loss / d logp_t = -w_t * min(r_t, 1 + eps_high) * A_t: every token keeps a gradient, where
    PPO-clip gives the tokens beyond the clip none."""
    adv, ratio = [1.0, 1.0, -1.0, -1.0, 2.0], [1.5, 1.1, 0.5, 1.3, 0.9]
    s = LossSettings(loss="examples.cispo:cispo_loss", off_policy="none", clip_low=0.2, clip_high=0.2)
    x = _inputs(adv, ratio)
    loss, stats = policy_loss(s, x)
    (grad,) = torch.autograd.grad(loss, x.logp)
    want = [-(1 / 5) * min(r, 1.2) * a for a, r in zip(adv, ratio)]
    assert grad.tolist() == pytest.approx(want, rel=1e-12) and float(stats["ppo_clipped_frac"]) == 2.0
    x = _inputs(adv, ratio)
    (ppo,) = torch.autograd.grad(policy_loss(LossSettings(loss="grpo", off_policy="none"), x)[0], x.logp)
    assert ppo[0] == 0 and ppo[2] == 0 and grad[0] != 0 and grad[2] != 0  # clipped by PPO, kept by CISPO


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-4, 4), min_size=1, max_size=9))
def test_examples_centered_rank_properties(rewards):
    adv = compute_advantages("examples.rank_advantage:centered_rank", rewards, [0] * len(rewards))
    assert all(-0.5 <= a <= 0.5 for a in adv) and abs(sum(adv)) < 1e-9
    for i, ri in enumerate(rewards):
        for j, rj in enumerate(rewards):
            assert (ri < rj) == (adv[i] < adv[j]) and (ri == rj) == (adv[i] == adv[j])
    spread = compute_advantages(
        "examples.rank_advantage:centered_rank", [math.exp(3 * r) for r in rewards], [0] * len(rewards)
    )
    assert spread == adv  # only the order matters


def test_examples_most_free_kv_picks_the_emptiest_instance_that_fits():
    """Instance 0 runs 50 short trajectories in little KV, 1 runs nothing in more KV, 2 has no room:
    MostFreeKV takes 0 (most free KV), where the waterfall's cost model prefers the idle 1."""
    from test_coordinator import COST, Clock, force, hold

    from staleflow.config import CoordinatorConfig
    from staleflow.controller.ledger import Traj
    from staleflow.coordinator import Coordinator, Route
    from staleflow.protocol.staleness import StalenessManager

    def first_routes(routing: str) -> list[tuple[int, int]]:
        c = Coordinator(
            CoordinatorConfig(routing=routing, migration=False),
            COST,
            StalenessManager(StalenessSpec(2, 4, group_size=1)),
            range(3),
            trajs={t: Traj(t, t, 0, prompt_len=100) for t in (1, 2)},
            clock=Clock(),
        )
        c.on_new_version(0)
        for k in range(50):  # 50 short trajectories held by instance 0 (as routes would put them there)
            hold(c, 0, 1000 + k, tokens=20)
        for inst, kv in ((0, 1_000), (1, 20_000), (2, 99_990)):
            force(c.instances[inst], kv_tokens=kv)
        c.submit([1, 2])
        return [(r.traj_id, r.instance) for r in c.tick(1.0) if isinstance(r, Route)]

    assert first_routes("examples.kv_router:MostFreeKV") == [(1, 0), (2, 0)]
    assert first_routes("waterfall") == [(1, 1), (2, 1)]
