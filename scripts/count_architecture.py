"""Count what docs/architecture.md counts, from the code and from a run (no estimate, no hand count):

    python scripts/count_architecture.py

- classes that hold a trajectory or part of it: every class of src/staleflow declaring a field that names
  one trajectory (``traj_id``, ``request_id``), holds its tokens (``prompt_ids``, ``response_ids``) or its
  multi-turn figures (``turns``, ``tool_calls`` and ``tool_s`` together), plus the forms of trajectory.py;
- tables keyed by trajectory id: every attribute, on an object of the package reachable from a simulated
  run's controller loop, holding a dict or set whose keys are all trajectory ids (trajectory, group,
  instance and version ids drawn from disjoint ranges so a key names one kind), sampled every turn of a
  short multi-turn run with migration (the rank side, workers/ and runtime/, is listed in the doc by reading);
- of those, the coordinator's (tests/test_sched_record.py pins at most 2);
- package import cycles and upward imports of the pure core (tests/test_layout.py pins 0 of each).
Prints a table, then one JSON line; tests/test_layout.py checks that docs/architecture.md quotes that line.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "staleflow"
ONE = {"traj_id", "request_id"}
PAYLOAD = {"prompt_ids", "response_ids"}
FIGURES = {"turns", "tool_calls", "tool_s"}
TRAJ_BASE, GROUP_BASE = 10**6, 5 * 10**5


def _fields(node: ast.ClassDef) -> set[str]:
    """Names a class declares: annotated class fields, __slots__, and self.<name> set in __init__."""
    names = {b.target.id for b in node.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)}
    for b in node.body:
        if isinstance(b, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in b.targets):
            if isinstance(b.value, (ast.Tuple, ast.List)):
                names |= {e.value for e in b.value.elts if isinstance(e, ast.Constant)}
        if isinstance(b, ast.FunctionDef) and b.name == "__init__":
            for n in ast.walk(b):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def trajectory_classes() -> list[str]:
    """'module.Class' of every class holding a trajectory or part of it (the rule in the docstring)."""
    from staleflow.trajectory import FORMS

    out = {f"trajectory.{c.__name__}" for c in FORMS}
    for path in sorted(SRC.rglob("*.py")):
        mod = ".".join(path.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                f = _fields(node)
                if f & ONE or f & PAYLOAD or FIGURES <= f:
                    out.add(f"{mod}.{node.name}")
    return sorted(out)


def _keyed_by(container, ids: range) -> bool:
    keys = list(container.keys() if isinstance(container, Mapping) else container)
    return bool(keys) and all(isinstance(k, int) and not isinstance(k, bool) and k in ids for k in keys)


def _tables(roots: list, ids: range, found: dict, owned: set) -> None:
    """(class, attribute) -> module of every attribute reachable from ``roots`` keyed by trajectory ids. A table
    reachable under several names counts once, for the first root that holds it (``owned``: the tables
    attributed so far); a read-only view of a table (a mappingproxy) is the table itself."""
    seen, todo = set(), list(reversed(roots))
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        cls = type(obj)
        if not cls.__module__.startswith("staleflow"):
            continue
        names = list(getattr(obj, "__dict__", {})) + [n for k in cls.__mro__ for n in getattr(k, "__slots__", ())]
        for name in names:
            v = getattr(obj, name, None)
            if isinstance(v, MappingProxyType):
                v = gc.get_referents(v)[0]  # a read-only view shows a table, it is not one
            if isinstance(v, (dict, set, frozenset)) and id(v) not in owned and _keyed_by(v, ids):
                owned.add(id(v))
                found.setdefault((cls.__name__, name), cls.__module__)
            if isinstance(v, Mapping):
                todo.extend(v.values())
            elif isinstance(v, (list, tuple, set, frozenset)):
                todo.extend(x for x in v if not isinstance(x, (int, float, str)))
            elif v is not None and not isinstance(v, (int, float, str, bytes)):
                todo.append(v)


def trajectory_tables(steps: int = 4) -> dict[tuple[str, str], str]:
    """Tables keyed by trajectory id in a short simulated multi-turn run with migration (cpu-small shape)."""
    import dataclasses

    from staleflow.sim.config import preset_cpu_small
    from staleflow.sim.simulator import build

    cfg = dataclasses.replace(preset_cpu_small(), tool_calls_max=2, steps=steps + 2, ablation=False)
    loop, backend, _ = build(cfg, "staleflow", 2)
    loop.ledger.next_traj, loop.ledger.next_group = TRAJ_BASE, GROUP_BASE  # disjoint id ranges
    found, owned, turns = {}, set(), [0]
    roots = [loop.ledger, loop.manager, loop.coord, backend, loop]  # owners first: a lent table counts for them

    def sample() -> bool:
        turns[0] += 1
        if turns[0] % 10 == 0:
            _tables(roots, range(TRAJ_BASE, loop.ledger.next_traj), found, owned)
        return len(loop.steps) >= steps

    loop.run(until=sample)
    return found


def layout() -> tuple[int, int]:
    """(package cycles, upward imports of the pure core), by tests/test_layout.py's own functions."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_layout as tl

    return len(tl.package_cycles()), sum(len(v) for v in tl.upward_imports().values())


def counts() -> dict:
    classes = trajectory_classes()
    tables = trajectory_tables()
    cycles, upward = layout()
    return {
        "trajectory_classes": len(classes),
        "trajectory_tables": len(tables),
        "coordinator_tables": sum(m.startswith("staleflow.coordinator") for m in tables.values()),
        "package_cycles": cycles,
        "upward_imports": upward,
        "classes": classes,
        "tables": sorted(f"{m.removeprefix('staleflow.')}.{c}.{a}" for (c, a), m in tables.items()),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    c = counts()
    print(f"classes holding a trajectory or part of it: {c['trajectory_classes']}")
    for name in c["classes"]:
        print(f"  {name}")
    print(f"tables keyed by trajectory id reachable from a simulated run's loop: {c['trajectory_tables']}")
    for name in c["tables"]:
        print(f"  {name}")
    print(f"of which the coordinator's: {c['coordinator_tables']}")
    print(f"package cycles: {c['package_cycles']}; upward imports of the pure core: {c['upward_imports']}")
    print(json.dumps({k: c[k] for k in c if k not in ("classes", "tables")}))


if __name__ == "__main__":
    main()
