"""Nothing of ours shadows an installed package (issue 51): transformers >= 5.25 imports Hugging Face's
`kernels`, and the repository's top-level kernels/ folder used to hide it from every process started
in the repository root (python -m, torchrun, pytest), so every tokenizer load failed.

Checked through the import system itself, with a stand-in `kernels` package installed on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fake_install(tmp_path: Path, name: str = "kernels") -> Path:
    """A regular package `name` in a folder of its own (as pip would install it): its __init__ says who it is."""
    site = tmp_path / "site"
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("WHO = 'installed'\n")
    return site


def _python(code: str, cwd: Path, site: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_top_level_kernels_folder_is_not_a_package_and_every_module_is_linked():
    assert (ROOT / "kernels").is_dir() and not (ROOT / "kernels" / "__init__.py").exists()
    pkg = ROOT / "src" / "staleflow" / "kernels"
    assert (pkg / "__init__.py").is_file() and not (pkg / "__init__.py").is_symlink()
    sources = sorted(p.name for p in (ROOT / "kernels").glob("*.py"))
    assert sources, "kernels/ holds the kernel sources"
    for name in sources:
        link = pkg / name
        assert link.is_symlink() and link.resolve() == (ROOT / "kernels" / name).resolve(), name


def test_an_installed_kernels_package_wins_over_the_repository_folder(tmp_path):
    """python -c from the repository root puts it first on sys.path; the installed package still wins,
    and staleflow.kernels is a regular package with every module importable."""
    site = _fake_install(tmp_path)
    code = (
        "import sys, kernels, staleflow.kernels as k, staleflow.kernels.logprob, staleflow.kernels.paged_decode, "
        "staleflow.kernels.reference; print(kernels.WHO, k.__file__ is not None)"
    )
    out = _python(code, ROOT, site)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["installed", "True"]


def test_entry_points_take_the_working_directory_off(tmp_path):
    """A folder in the working directory that IS a regular package (what kernels/ was) cannot shadow an
    installed one once an entry point has run, a module there is not importable unless named on
    PYTHONPATH on purpose, and every Python started from there inherits PYTHONSAFEPATH."""
    site = _fake_install(tmp_path)
    cwd = tmp_path / "checkout"
    (cwd / "kernels").mkdir(parents=True)
    (cwd / "kernels" / "__init__.py").write_text("WHO = 'shadow'\n")
    (cwd / "my_reward.py").write_text("def score(*a):\n    return 1.0\n")
    code = (
        "import importlib.util, os, subprocess, sys; "
        "from staleflow.launch.import_path import working_directory_off; working_directory_off(); "
        "import kernels; "
        "child = subprocess.run([sys.executable, '-c', 'import sys; print(sys.flags.safe_path)'], "
        "capture_output=True, text=True).stdout.strip(); "
        "print(kernels.WHO, importlib.util.find_spec('my_reward') is not None, child, os.getcwd() in sys.path)"
    )
    before = _python("import kernels; print(kernels.WHO)", cwd, site)
    assert before.stdout.strip() == "shadow"  # what python -c / -m did to the installed package
    out = _python(code, cwd, site)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["installed", "False", "True", "False"]
    # named on purpose (PYTHONPATH=$PWD, docs/extending.md): the user's module imports, kernels still installed
    out = _python(code, cwd, Path(f"{site}{os.pathsep}{cwd}"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["installed", "True", "True", "True"]


def test_the_command_line_runs_with_the_working_directory_off(tmp_path):
    """staleflow.cli.main on the process's own command line (python -m staleflow, the staleflow script,
    torchrun's workers) takes it off first; called with an argv (a test, a library), it leaves sys.path alone."""
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    probe = (
        "import contextlib, io, os, sys\n"
        "from staleflow.cli import main\n"
        "sys.argv = ['staleflow', '--help']\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main()\n"
        "print(os.getcwd() in sys.path, '' in sys.path)"
    )
    out = _python(probe, cwd, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_the_command_line_called_with_an_argv_leaves_the_caller_alone(monkeypatch, capsys):
    import pytest

    from staleflow.cli import main

    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    before = list(sys.path)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert sys.path == before and "PYTHONSAFEPATH" not in os.environ
    assert "commands:" in capsys.readouterr().out
