"""A run folder never chooses code (issue 50): an extension spec in a resumed run's saved config.json
is re-resolved only when the user names it again or it is a registered name / an installed module
outside the working directory and every run folder (launch/saved_code.py); and no process imports a
module from a run folder, whoever names it (extensions.import_refusal).

The attacker's view, as in the issue: someone who can write ``runs/victim`` plants ``payload.py``
there and points the saved config's ``reward.fn`` (or ``train.loss``) at ``runs.victim.payload:f``;
``python -m`` puts the working directory (where ``runs/`` lives) on the import path, so before the
fix ``staleflow check --resume runs/victim`` imported it (the canary file appeared, exit 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.config import RunConfig, resolve
from staleflow.extensions import ExtensionError, import_refusal, module_files, protect_folders
from staleflow.launch.saved_code import check_saved_code, saved_specs
from staleflow.presets import PRESETS
from staleflow.reward.functions import REWARDS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint_readers import make_checkpoint  # noqa: E402

PAYLOAD = (
    "import pathlib\npathlib.Path({canary!r}).write_text('ran')\n\ndef f(completion, answer, meta):\n    return 1.0\n"
)
LOSS_PAYLOAD = (
    "import pathlib\npathlib.Path({canary!r}).write_text('ran')\n\ndef f(settings, inputs, logp_old):\n    return 0\n"
)


def _victim(root: Path, key: str, spec: str, payload: str) -> tuple[Path, Path]:
    """runs/victim under ``root``: a tiny run's saved config with ``key`` set to ``spec``, an intact
    checkpoint, a run.lock left by its (dead) writer and the planted module."""
    run = root / "runs" / "victim"
    make_checkpoint(run / "checkpoints", 2)
    cfg = dataclasses.asdict(resolve(PRESETS["tiny"]()))
    if "." in key:
        section, field = key.split(".")
        cfg[section][field] = spec
    else:  # a top-level key (--mode)
        cfg[key] = spec
    (run / "config.json").write_text(json.dumps(cfg))
    (run / "run.lock").write_text("4242\n")
    canary = root / "PWNED"
    (run / "payload.py").write_text(payload.format(canary=str(canary)))
    return run, canary


def _check(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "STALEFLOW_NO_IMPORT_UNDER"}
    # the worst case: the user put the checkout (where runs/ lives) on the import path on purpose
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "staleflow", "check", "--preset", "tiny", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize(
    "key,payload",
    [("reward.fn", PAYLOAD), ("train.loss", LOSS_PAYLOAD), ("mode", PAYLOAD)],
    ids=["reward_fn", "train_loss", "mode"],
)
def test_resume_code_planted_in_the_run_folder_never_runs(tmp_path, key, payload):
    run, canary = _victim(tmp_path, key, "runs.victim.payload:f", payload)
    res = _check(tmp_path, "--resume", "runs/victim")
    assert not canary.exists(), "the planted module ran"
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("staleflow: config error:"), res.stderr[-2000:]
    flag = "--" + key.replace("_", "-")
    assert f"{flag}='runs.victim.payload:f'" in lines[0] and "run folder" in lines[0], lines[0]
    # Named again on the command line it is the user's choice, but a run folder is still never imported from.
    res = _check(tmp_path, "--resume", "runs/victim", flag, "runs.victim.payload:f")
    assert not canary.exists() and res.returncode == 2, res.stderr[-2000:]
    assert "code is never imported from a run folder" in res.stderr, res.stderr[-2000:]


def test_resume_code_a_run_folder_without_its_lock_file_is_still_refused(tmp_path):
    """The attacker removes run.lock too: the run folder is still protected (--resume and --log.run-dir)."""
    run, canary = _victim(tmp_path, "reward.fn", "runs.victim.payload:f", PAYLOAD)
    (run / "run.lock").unlink()
    res = _check(tmp_path, "--resume", "runs/victim")
    assert not canary.exists()
    assert res.returncode == 2 and "--reward.fn='runs.victim.payload:f'" in res.stderr, res.stderr[-2000:]


def test_resume_code_a_saved_spec_under_the_working_directory_must_be_named_again(tmp_path):
    """A module of the user's own checkout (not the run folder) chosen by the saved config only:
    refused with the flag to pass; named again, the resume goes on and imports it."""
    (tmp_path / "myfork").mkdir()
    (tmp_path / "myfork" / "rewards.py").write_text(PAYLOAD.format(canary=str(tmp_path / "IMPORTED")))
    run, _ = _victim(tmp_path, "reward.fn", "myfork.rewards:f", PAYLOAD)
    res = _check(tmp_path, "--resume", "runs/victim")
    assert res.returncode == 2 and not (tmp_path / "IMPORTED").exists(), res.stderr[-2000:]
    assert "name it again on the command line: --reward.fn myfork.rewards:f" in res.stderr, res.stderr
    res = _check(tmp_path, "--resume", "runs/victim", "--reward.fn", "myfork.rewards:f")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "IMPORTED").exists()  # the user's own choice is imported, as for a new run


def test_resume_code_registered_names_and_installed_modules_pass(tmp_path):
    base = resolve(PRESETS["tiny"]())
    saved = dataclasses.replace(
        base,
        reward=dataclasses.replace(base.reward, fn="countdown"),
        train=dataclasses.replace(base.train, advantage="json:dumps"),  # an installed (stdlib) module
    )
    assert saved_specs(saved, base) == [("--train.advantage", "json:dumps")]
    check_saved_code(saved, base, str(tmp_path))  # json lives outside the working directory: accepted
    planted = dataclasses.replace(base, reward=dataclasses.replace(base.reward, fn="tests_nowhere_xyz:f"))
    with pytest.raises(Exception, match="cannot be found"):
        check_saved_code(planted, base, str(tmp_path))


def test_resume_code_the_resolver_refuses_a_protected_folder_in_any_process(tmp_path, monkeypatch):
    """Defence in depth: Registry.resolve locates the module without running it and refuses one whose
    file lies under a protected folder or a folder holding run.lock, whatever the spec's origin."""
    monkeypatch.delenv("STALEFLOW_NO_IMPORT_UNDER", raising=False)
    pkg = tmp_path / "outside" / "plantpkg"
    pkg.mkdir(parents=True)
    canary = tmp_path / "canary"
    (pkg / "__init__.py").write_text(f"open({str(canary)!r}, 'w').write('ran')\n")
    (pkg / "mod.py").write_text("def f(completion, answer, meta):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "outside"))
    assert module_files("plantpkg.mod") and not canary.exists()  # located, not run
    protect_folders(str(tmp_path / "outside"))
    assert "plantpkg" in (import_refusal("plantpkg.mod") or "")
    with pytest.raises(ExtensionError, match="code is never imported from a run folder"):
        REWARDS.resolve("plantpkg.mod:f")
    assert not canary.exists() and "plantpkg" not in sys.modules
    monkeypatch.delenv("STALEFLOW_NO_IMPORT_UNDER")
    (pkg / "run.lock").write_text("1\n")  # a run folder, marked by its lock file
    with pytest.raises(ExtensionError, match="run folder"):
        REWARDS.resolve("plantpkg.mod:f")
    assert not canary.exists()
    (pkg / "run.lock").unlink()
    assert REWARDS.resolve("plantpkg.mod:f")(None, None, None) == 1.0  # an ordinary folder: imported
    assert canary.exists()


def test_resume_code_given_config_is_the_users_choice():
    """A spec that equals this command line's value (flag, --config file or preset) is not 'saved'."""
    base = resolve(PRESETS["tiny"]())
    mine = dataclasses.replace(base, train=dataclasses.replace(base.train, loss="examples.cispo:cispo_loss"))
    assert saved_specs(mine, mine) == []
    assert saved_specs(mine, base) == [("--train.loss", "examples.cispo:cispo_loss")]
    assert isinstance(mine, RunConfig)


def test_resume_code_a_saved_fork_mode_is_refused_before_anything_imports_it(tmp_path, monkeypatch):
    """--mode takes a fork's 'package.module:Class' (modes/base.py): a saved config naming one under the
    working directory is refused like any extension spec, and before resolve() would import it."""
    from staleflow.config import ConfigError
    from staleflow.launch.resume import resumed_config

    (tmp_path / "myfork").mkdir()
    (tmp_path / "myfork" / "modes.py").write_text(PAYLOAD.format(canary=str(tmp_path / "IMPORTED")))
    run, _ = _victim(tmp_path, "mode", "myfork.modes:f", PAYLOAD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the worst case: the working directory importable
    base = resolve(PRESETS["tiny"]())
    saved = dataclasses.replace(base, mode="myfork.modes:f")
    assert ("--mode", "myfork.modes:f") in saved_specs(saved, base)
    with pytest.raises(ConfigError, match="--mode='myfork.modes:f'"):
        resumed_config(str(run), dataclasses.replace(base, resume=str(run)), base, frozenset())
    assert not (tmp_path / "IMPORTED").exists()
