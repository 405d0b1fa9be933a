"""The layout is the architecture: no import cycles (module- or function-level) between modules nor
between packages, launch/ imported by nothing below it, and no file over 400 lines in src/staleflow
and kernels/ (docs/architecture.md, CONVENTIONS.md)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    mods = {}
    src = ROOT / "src"
    for dirpath, _, files in os.walk(src / "staleflow", followlinks=True):
        for f in files:
            if f.endswith(".py"):
                p = Path(dirpath) / f
                name = ".".join(p.relative_to(src).with_suffix("").parts)
                mods[name.removesuffix(".__init__")] = p
    return mods


_STRING_IMPORT = re.compile(r"^(staleflow(?:\.\w+)+):\w+$")  # "package.module:attr", as dispatch tables write it


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every staleflow module this file imports anywhere (top level or inside functions), including
    by name in a string ("staleflow.launch.entry:main" in a dispatch table, importlib)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := _STRING_IMPORT.match(node.value)):
            names = [m.group(1)]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def import_cycles() -> list[list[str]]:
    mods = _modules()
    return _cycles({m: _imports(p, set(mods)) - {m} for m, p in mods.items()})


def _package(module: str) -> str:
    """staleflow.control.hub -> staleflow.control; a top-level module (staleflow.faults) is its own."""
    return ".".join(module.split(".")[:2])


def package_edges() -> dict[str, set[str]]:
    """Package -> the other packages its modules import (anywhere in a file, or by name in a string)."""
    mods = _modules()
    return _package_graph({m: _imports(p, set(mods)) for m, p in mods.items()})


def _package_graph(module_edges: dict[str, set[str]]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {_package(m): set() for m in module_edges}
    for m, deps in module_edges.items():
        edges[_package(m)] |= {_package(i) for i in deps} - {_package(m)}
    return edges


def package_cycles() -> list[list[str]]:
    return _cycles(package_edges())


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each one or more cycles)."""
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_layout_no_import_cycles():
    assert import_cycles() == []


def test_layout_no_package_cycles():
    """No package imports a package that imports it back, through any chain (issue 38: launch <->
    cluster, control, workers, runtime and cluster <-> control were cycles with no module cycle)."""
    assert package_cycles() == []


def test_layout_package_cycle_detector_finds_a_cycle_without_a_module_cycle():
    """a.x -> b.y and b.z -> a.w: no module imports itself back, the packages do."""
    edges = {
        "staleflow.a.x": {"staleflow.b.y"},
        "staleflow.b.y": set(),
        "staleflow.b.z": {"staleflow.a.w"},
        "staleflow.a.w": set(),
        "staleflow.c": {"staleflow.a.x"},
    }
    assert _cycles(edges) == []
    assert _cycles(_package_graph(edges)) == [["staleflow.a", "staleflow.b"]]
    assert (
        _package("staleflow.control.hub") == "staleflow.control" and _package("staleflow.faults") == "staleflow.faults"
    )


def test_layout_nothing_below_launch_imports_it():
    """launch/ only starts processes: no other package (the CLI's dispatch table aside) imports it."""
    users = sorted(p for p, deps in package_edges().items() if "staleflow.launch" in deps)
    assert users == ["staleflow.cli"]


def test_layout_cycle_detector_sees_function_level_imports(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from staleflow.b import x\n")
    assert _imports(a, {"staleflow.b"}) == {"staleflow.b"}


def test_layout_cycle_detector_sees_string_imports(tmp_path):
    a = tmp_path / "a.py"
    a.write_text(
        'COMMANDS = {"run": "staleflow.b:main"}\nlog = getLogger("staleflow.c")\n'
        'import importlib\nm = importlib.import_module("staleflow.d")\n'
    )
    assert _imports(a, {"staleflow.b", "staleflow.c", "staleflow.d"}) == {"staleflow.b", "staleflow.d"}


CORE = ("staleflow.protocol", "staleflow.modes", "staleflow.coordinator", "staleflow.controller", "staleflow.config")
SHELLS = ("staleflow.runtime", "staleflow.workers", "staleflow.launch", "staleflow.sim", "staleflow.cli")


def upward_imports() -> dict[str, list[str]]:
    """Module of the pure core -> the shell modules it imports (should be none)."""
    mods = _modules()
    bad = {m: sorted(i for i in _imports(p, set(mods)) if i.startswith(SHELLS)) for m, p in mods.items()}
    return {m: v for m, v in bad.items() if v and m.startswith(CORE)}


def test_layout_packages_do_not_import_upward():
    """The core never imports the shells: protocol, modes, coordinator, controller (the loop) and the config
    import nothing from the runtime, the rank workers, the launcher or the simulator."""
    assert upward_imports() == {}


def test_layout_config_sits_below_the_coordinator_and_modes_below_both():
    """Issue 48: config/ no longer imports coordinator/ (a mode, with its flag section, is staleflow.modes), and
    the modes import neither (a peer's file holds its rule, knobs and search on protocol/ alone)."""
    edges = package_edges()
    assert "staleflow.coordinator" not in edges["staleflow.config"]
    assert not edges["staleflow.modes"] & {"staleflow.config", "staleflow.coordinator", "staleflow.controller"}


@pytest.mark.scripts_smoke  # tests/test_scripts_smoke.py's row of count_architecture.py
def test_layout_architecture_counts_are_the_docs():
    """docs/architecture.md quotes the JSON line of `python scripts/count_architecture.py` (classes holding a
    trajectory, tables keyed by trajectory id in a simulated run, the coordinator's, cycles, upward imports):
    the doc counts what this counts, and a change in the code that moves a count fails here until the doc
    says so."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("count_architecture", ROOT / "scripts" / "count_architecture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.counts()
    line = json.dumps({k: c[k] for k in c if k not in ("classes", "tables")})
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert line in doc, f"docs/architecture.md must quote the counts: {line}"
    assert all(f"`{name}`" in doc for name in c["classes"] + c["tables"]), "the doc names every counted one"
    assert c["coordinator_tables"] <= 2 and c["package_cycles"] == c["upward_imports"] == 0


def test_layout_no_file_over_400_lines():
    files = list((ROOT / "src" / "staleflow").rglob("*.py")) + list((ROOT / "kernels").glob("*.py"))
    long = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_layout_readme_names_every_package_and_module():
    """The README's layout block lists every subpackage and top-level module of src/staleflow, and
    names nothing that is not there."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Layout") :]
    block = block[block.index("```") + 3 :]
    block = block[: block.index("```")]
    pkg = ROOT / "src" / "staleflow"
    there = {p.name + "/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    there |= {p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    named = set(re.findall(r"\b([a-z_]+/|[a-z_]+\.py)", block))
    missing = sorted(n for n in there if n not in named)
    assert missing == [], f"README's layout does not mention {missing}"
    top = {
        n
        for n in named
        if n.endswith("/") and not (ROOT / n).is_dir() and not (pkg / n).is_dir() and not (ROOT / "src" / n).is_dir()
    }
    assert top == set(), f"README's layout names what does not exist: {sorted(top)}"
