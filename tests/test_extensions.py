"""Extension points (staleflow/extensions.py, docs/extending.md): one Registry per kind, a
registered name or 'package.module:name' for --train.loss / advantage / off-policy,
--coordinator.routing / pull, --data.source and --reward.fn, every bad spec a one-line error from
`staleflow check` (exit 2) before any process starts, the built-ins found through the same
registries, and a fork's object called on the runtime's own path."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_coordinator import COST, Clock
from test_extension_helpers import two_args

from staleflow.config import CoordinatorConfig, DataConfig, RewardConfig, TrainConfig
from staleflow.controller.ledger import Traj
from staleflow.coordinator import Coordinator, Pull, Route
from staleflow.coordinator.strategies import PULL, ROUTING
from staleflow.data import DataError, PromptSource
from staleflow.data.tasks import TASKS
from staleflow.extensions import ExtensionError, Registry, Shape
from staleflow.launch import check
from staleflow.protocol import StalenessSpec
from staleflow.protocol.staleness import StalenessManager
from staleflow.reward.functions import REWARDS, resolve_reward_fn
from staleflow.train.advantages import ADVANTAGES, compute_advantages
from staleflow.train.losses import LOSSES, OFF_POLICIES, LossInputs, LossSettings, policy_loss, token_weights

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
H = "test_extension_helpers"


# ---- the registry mechanism ---------------------------------------------------------------------
def test_extension_registry_names_paths_and_one_error_format():
    widgets = Registry("widget", "--x.widget", Shape.function(1, "fn(rewards) -> advantages"))

    @widgets.register("double")
    def double(rewards):
        return [2 * r for r in rewards]

    assert widgets.resolve("double") is double and "double" in widgets and list(widgets) == ["double"]
    assert widgets.resolve(f"{H}:sign_advantage")([0.0, 1.0, 2.0]) == [-1.0, 0.0, 1.0]
    bad = {
        "dubble": "is not a registered widget (double) nor an import path 'package.module:name'",
        ":f": "an import path must look like 'package.module:name'",
        "no_such_module_xyz:f": "cannot import module 'no_such_module_xyz' (ModuleNotFoundError",
        f"{H}:nope": f"module '{H}' has no attribute 'nope'",
        f"{H}:NOT_CALLABLE": "'NOT_CALLABLE' is an int, not a callable",
        f"{H}:two_args": "'two_args' is function two_args(a, b), which cannot be called with 1 positional argument",
        f"{H}:NoChoose": "'NoChoose' is class NoChoose, not a function",
    }
    for spec, words in bad.items():
        with pytest.raises(ExtensionError) as e:
            widgets.resolve(spec)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"--x.widget={spec!r}") and words in msg, msg
        assert msg.endswith("; a widget is fn(rewards) -> advantages")
    with pytest.raises(TypeError, match="widget 'pair' is function two_args"):  # built-ins are checked too
        widgets.register("pair")(two_args)
    with pytest.raises(ValueError, match="no ':'"):
        widgets["a:b"] = double


def test_extension_module_that_fails_while_importing_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_fork.py").write_text("x = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ExtensionError) as e:
        LOSSES.resolve("broken_fork:loss")
    assert "cannot import module 'broken_fork' (ZeroDivisionError: division by zero)" in str(e.value)


def test_extension_class_shapes():
    assert ROUTING.resolve(f"{H}:LastInstance").__name__ == "LastInstance"
    assert PULL.resolve(f"{H}:NeverPull").__name__ == "NeverPull"
    for registry, spec, words in (
        (ROUTING, f"{H}:NoChoose", "class NoChoose without a method choose()"),
        (ROUTING, f"{H}:sign_advantage", "function sign_advantage(rewards), not a class"),
        (PULL, f"{H}:PullWithoutFlags", "without a bool attribute blocks_routing"),
        (OFF_POLICIES, f"{H}:bad_flag", "whose recompute_proximal is a str, not a bool"),
    ):
        with pytest.raises(ExtensionError, match=re.escape(words)):
            registry.resolve(spec)


def test_extension_import_path_code_exists_once():
    """The reward, the losses, the strategies and the data sources share extensions.py: no module
    of the package imports a module by a user's name but it (cli.py imports its own subcommands)."""
    users = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "src" / "staleflow").rglob("*.py")
        if "import_module(" in p.read_text()
    )
    # sandbox/harness.py runs INSIDE the sandbox (never imported by staleflow) and imports only the
    # standard-library modules a solution named, in its own clean interpreter (docs/sandbox.md).
    assert users == ["src/staleflow/cli.py", "src/staleflow/extensions.py", "src/staleflow/sandbox/harness.py"]


# ---- staleflow check: every flag, before any process ---------------------------------------------
BAD = [
    ("--train.loss", "grpoo", "is not a registered loss (grpo, gspo, ppo)"),
    ("--train.loss", f"{H}:nope", f"module '{H}' has no attribute 'nope'"),
    ("--train.loss", f"{H}:two_args", "cannot be called with 3 positional arguments"),
    ("--train.advantage", "no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("--train.advantage", f"{H}:two_args", "cannot be called with 1 positional argument"),
    ("--train.off-policy", "tis", "is not a registered off-policy correction"),
    ("--train.off-policy", f"{H}:NOT_CALLABLE", "an int, not a callable"),
    ("--train.off-policy", f"{H}:bad_flag", "recompute_proximal is a str, not a bool"),
    ("--coordinator.routing", "no_such_module_xyz:Router", "cannot import module 'no_such_module_xyz'"),
    ("--coordinator.routing", f"{H}:NoChoose", "class NoChoose without a method choose()"),
    ("--coordinator.pull", f"{H}:Nope", f"module '{H}' has no attribute 'Nope'"),
    ("--coordinator.pull", f"{H}:PullWithoutFlags", "without a bool attribute blocks_routing"),
    (
        "--data.source",
        "arithmetc",
        "is not a registered task (arithmetic, arithmetic-easy, countdown, word-steps), a .jsonl",
    ),
    ("--data.source", "no_such_module_xyz:rows", "cannot import module 'no_such_module_xyz'"),
    ("--data.source", f"{H}:sign_advantage", "cannot be called with 2 positional arguments"),
    ("--data.source", "missing.jsonl", "no such file"),
    ("--reward.fn", f"{H}:nope", f"module '{H}' has no attribute 'nope'"),
    ("--reward.fn", f"{H}:NoChoose", "class NoChoose, not a function"),
]


@pytest.mark.parametrize("flag, spec, words", BAD)
def test_extension_bad_spec_is_one_line_from_check(flag, spec, words, tmp_path, capsys):
    """The same function launch.sh runs first (`python -m staleflow check`), here in-process."""
    assert check.main(["--preset", "tiny", "--log.run-dir", str(tmp_path), flag, spec]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"staleflow: config error: {flag}={spec!r}") and words in last, last


def test_extension_check_accepts_a_run_made_of_forks(tmp_path, capsys):
    flags = [
        "--train.loss",
        f"{H}:reinforce",
        "--train.advantage",
        f"{H}:sign_advantage",
        "--train.off-policy",
        f"{H}:half_tis",
        "--coordinator.routing",
        f"{H}:LastInstance",
        "--coordinator.pull",
        f"{H}:NeverPull",
        "--data.source",
        f"{H}:squares",
        "--reward.fn",
        "e2e_rewards:text_length",
    ]
    assert check.main(["--preset", "tiny", "--log.run-dir", str(tmp_path), *flags]) == 0, capsys.readouterr().err


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def test_extension_check_cli_exits_2_with_one_line(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "staleflow",
            "check",
            "--preset",
            "tiny",
            "--log.run-dir",
            str(tmp_path),
            "--train.loss",
            f"{H}:two_args",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"staleflow: config error: --train.loss='{H}:two_args'")


@pytest.mark.slow
def test_extension_launch_stops_before_any_process_starts(tmp_path):
    r = subprocess.run(
        [
            "bash",
            str(ROOT / "launch.sh"),
            "--preset",
            "tiny",
            "--log.run-dir",
            str(tmp_path),
            "--coordinator.routing",
            "no_such_module_xyz:Router",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "--coordinator.routing='no_such_module_xyz:Router': cannot import module" in out
    assert "torch.distributed" not in out and "memory plan" not in out and not any(tmp_path.iterdir())


# ---- the built-ins are found through the registries -------------------------------------------------
def _recording(registry, name, calls, monkeypatch):
    """Replace a built-in by a wrapper of the same shape that records its calls."""
    inner = registry[name]
    if inspect.isclass(inner):

        def init(self, cfg, cost_model):
            calls.append(name)
            inner.__init__(self, cfg, cost_model)

        wrapper = type(f"Recorded{inner.__name__}", (inner,), {"__init__": init})
    else:

        def wrapper(*args):
            calls.append(name)
            return inner(*args)

    monkeypatch.setitem(registry, name, wrapper)


def _inputs(seed=0, lens=(3, 1, 4), gap=0.3):
    g = torch.Generator().manual_seed(seed)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    n = len(seq)
    logp = (-torch.rand(n, generator=g) * 3).requires_grad_()
    prox = logp.detach().clone()
    return LossInputs(
        logp=logp,
        behaviour_logp=prox + gap * torch.randn(n, generator=g),
        proximal_logp=prox,
        advantages=torch.randn(len(lens), generator=g)[seq],
        token_weight=torch.tensor(token_weights("token-mean", list(lens)))[seq],
        seq_index=seq,
        num_seqs=len(lens),
    )


def _coordinator(**cfg):
    cfg.setdefault("migration", False)
    manager = StalenessManager(StalenessSpec(2, 4, group_size=1))
    c = Coordinator(CoordinatorConfig(**cfg), COST, manager, range(3), trajs={}, clock=Clock())
    c.on_new_version(0)
    return c, manager


@pytest.fixture(scope="module")
def tok():
    from staleflow.model import load_tokenizer
    from staleflow.model.aliases import ensure_tokenizer

    return load_tokenizer(str(ensure_tokenizer()))


def test_extension_builtins_are_called_through_their_registry(monkeypatch, tok):
    calls: list[str] = []
    for registry, name in (
        (LOSSES, "grpo"),
        (OFF_POLICIES, "tis-token"),
        (ADVANTAGES, "grpo"),
        (ROUTING, "waterfall"),
        (PULL, "status"),
        (TASKS, "arithmetic"),
        (REWARDS, "arithmetic"),
    ):
        _recording(registry, name, calls, monkeypatch)
    policy_loss(LossSettings(loss="grpo", off_policy="tis-token"), _inputs())
    compute_advantages("grpo", [0.0, 1.0], [0, 0])
    _coordinator(routing="waterfall", pull="status")
    next(PromptSource(DataConfig(source="arithmetic", chat_template=False), tok))
    resolve_reward_fn(RewardConfig().fn)("\\boxed{4}", "4", {})
    assert calls == ["tis-token", "grpo", "grpo", "waterfall", "status", "arithmetic", "arithmetic"]


# ---- a fork's objects on the runtime's own paths --------------------------------------------------
def test_extension_off_policy_and_loss_by_import_path():
    x = _inputs(seed=3)
    full, _ = policy_loss(LossSettings(off_policy="tis-token"), x)
    half, stats = policy_loss(LossSettings(off_policy=f"{H}:half_tis"), x)
    assert float(half.detach()) == pytest.approx(0.5 * float(full.detach()), rel=1e-6) and float(full.detach()) != 0
    assert float(stats["is_weight"]) == pytest.approx(0.5 * float(policy_loss(LossSettings(), x)[1]["is_weight"]))
    assert LossSettings(off_policy=f"{H}:always_recompute").recompute_proximal
    assert LossSettings(off_policy="decoupled").recompute_proximal and not LossSettings().recompute_proximal
    with pytest.raises(ValueError, match=rf"--train.loss='{H}:per_sequence_loss' returned a per-token loss of shape"):
        policy_loss(LossSettings(loss=f"{H}:per_sequence_loss"), x)


def test_extension_advantage_by_import_path():
    rewards, groups = [0.0, 1.0, 5.0, 2.0, 2.0], [0, 0, 0, 1, 1]
    assert compute_advantages(f"{H}:sign_advantage", rewards, groups) == [-1.0, -1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=rf"--train.advantage='{H}:no_advantage' returned \[\] for a group of 3"):
        compute_advantages(f"{H}:no_advantage", rewards, groups)


def test_extension_routing_and_pull_by_import_path():
    c, _ = _coordinator(routing=f"{H}:LastInstance")
    c.trajs[1] = Traj(1, 1, 0, prompt_len=10)  # the ledger's record the strategy receives
    c.submit([1])
    assert [(r.traj_id, r.instance) for r in c.tick(1.0) if isinstance(r, Route)] == [(1, 2)]
    for pull, pulls in (("greedy", 3), (f"{H}:NeverPull", 0)):  # a new version: greedy pulls everywhere
        c, m = _coordinator(pull=pull)
        m.version = 1
        c.on_new_version(1)
        assert sum(isinstance(x, Pull) for x in c.tick(1.0)) == pulls


def test_extension_data_source_by_import_path(tok):
    src = PromptSource(DataConfig(source=f"{H}:squares", chat_template=False, seed=3), tok)
    held = src.hold_out(1)
    assert (held[0].text.split("?")[0], held[0].answer) == ("What is -1 squared", "1")
    p = next(src)
    assert (p.text.split("?")[0], p.answer, p.meta["k"]) == ("What is 0 squared", "0", 0)
    with pytest.raises(DataError, match=rf"--data.source='{H}:empty_prompt' row 0 is \('', '1', \{{\}}\); a task "):
        next(PromptSource(DataConfig(source=f"{H}:empty_prompt", chat_template=False), tok))


def test_extension_flags_help_lists_every_builtin():
    """tyro shows each field's docstring as its --help: it names every built-in and the import path."""
    config = ROOT / "src" / "staleflow" / "config"
    classes = [n for f in ("sections.py", "job.py") for n in ast.parse((config / f).read_text()).body]
    docs = {}
    for cls in (n for n in classes if isinstance(n, ast.ClassDef)):
        for a, b in zip(cls.body, cls.body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[(cls.name, a.target.id)] = b.value.value
    for (section, name), registry in {
        ("TrainConfig", "loss"): LOSSES,
        ("TrainConfig", "advantage"): ADVANTAGES,
        ("TrainConfig", "off_policy"): OFF_POLICIES,
        ("CoordinatorConfig", "routing"): ROUTING,
        ("CoordinatorConfig", "pull"): PULL,
        ("DataConfig", "source"): TASKS,
        ("RewardConfig", "fn"): REWARDS,
    }.items():
        text = docs[(section, name)]
        missing = [n for n in registry if n not in text.replace("\n", " ")]
        assert missing == [] and "module:" in text, (section, name, missing)
    assert TrainConfig(off_policy="my_fork.corrections:mine").off_policy == "my_fork.corrections:mine"
