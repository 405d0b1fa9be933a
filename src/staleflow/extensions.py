"""Extension points: one registry per kind of pluggable object, resolved and checked once at start-up.

Each kind (loss, advantage estimator, off-policy correction, routing strategy, pull policy, data
source, reward, rollout engine) has ONE ``Registry``: registered name -> object, plus import paths. The built-ins
register themselves in it, so a research fork's object is found, checked and called on the same
path as a built-in::

    LOSSES = Registry("loss", "--train.loss", Shape.function(3, "fn(settings, inputs, logp_old) -> ..."))

    @LOSSES.register("grpo")
    def ppo_clip(s, x, logp_old): ...

    LOSSES.resolve("grpo")                           # the built-in
    LOSSES.resolve("examples.cispo:cispo_loss")      # 'package.module:name', imported here

A spec that does not resolve is an ExtensionError, one line of the form
``--FLAG='SPEC': what is wrong; a KIND is SHAPE`` (a ConfigError: ``staleflow check`` prints it and
exits 2 before any process starts, and a rank meeting it stops the run without a restart). Pure:
no torch; its only I/O is finding (stat) and importing the module a spec names. docs/extending.md
lists every kind.

Where an import path may come from (docs/recovery.md, "What is trusted"): before a module is imported,
the import system's own finders locate it WITHOUT running it (``module_files``), and the import is
refused when any file or folder of it (each package level, every namespace portion, symlinks resolved
or not) lies inside a run folder: a folder holding ``run.lock``, or one registered with
``protect_folders`` (every process protects ``--log.run-dir`` and its run folder; the list rides in
``STALEFLOW_NO_IMPORT_UNDER`` to the processes it starts). A spec read back from a run's saved
config is held to more (launch/saved_code.py): it must also lie outside the working directory.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import os
import sys
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from staleflow.faults import ConfigError

T = TypeVar("T")
IMPORT_PATH = "'package.module:name'"
PROTECTED_ENV = "STALEFLOW_NO_IMPORT_UNDER"
"""Folders (os.pathsep-separated real paths) no extension module may come from; inherited by child processes."""
RUN_FOLDER_MARK = "run.lock"
"""A folder holding this file is a run folder (runfolder/lock.py): nothing under it is ever imported."""


class ExtensionError(ConfigError):
    """An extension spec that does not resolve: unknown name, unimportable path, wrong shape."""


@dataclass(frozen=True)
class Shape:
    """What an object of one kind must look like, checked without calling it.

    A function kind (``is_class=False``): callable with ``args`` positional arguments. A class kind:
    a class whose constructor takes ``args`` positional arguments and that has each of ``methods``
    (name, positional arguments after self) and each of ``attrs`` (name, type). ``optional`` attributes
    may be missing; when present they must have their type.
    """

    text: str
    """The interface in one phrase, shown in every error: e.g. 'fn(rewards) -> advantages'."""
    args: int
    is_class: bool = False
    methods: tuple[tuple[str, int], ...] = ()
    attrs: tuple[tuple[str, type], ...] = ()
    optional: tuple[tuple[str, type], ...] = ()

    @classmethod
    def function(cls, args: int, text: str, optional: tuple[tuple[str, type], ...] = ()) -> Shape:
        return cls(text=text, args=args, optional=optional)

    @classmethod
    def klass(
        cls, args: int, text: str, methods: tuple[tuple[str, int], ...] = (), attrs: tuple[tuple[str, type], ...] = ()
    ) -> Shape:
        return cls(text=text, args=args, is_class=True, methods=methods, attrs=attrs)

    def problem(self, obj) -> str | None:
        """Why ``obj`` does not fit this shape (a phrase: '<what it is>, <what is wrong>'), or None."""
        if self.is_class:
            if not inspect.isclass(obj):
                return f"{_describe(obj)}, not a class"
            if not _takes(obj, self.args):
                return f"class {obj.__name__}{_params(obj)}, whose constructor cannot take {_count(self.args)}"
            for name, n in self.methods:
                method = getattr(obj, name, None)
                if not callable(method):
                    return f"class {obj.__name__} without a method {name}()"
                if not _takes(method, n + 1):
                    return f"class {obj.__name__} whose {name}{_params(method)} cannot take self + {_count(n)}"
        else:
            if inspect.isclass(obj):
                return f"{_describe(obj)}, not a function (a class is called to build an object)"
            if not callable(obj):
                return f"{_describe(obj)}, not a callable"
            if not _takes(obj, self.args):
                return f"{_describe(obj)}, which cannot be called with {_count(self.args)}"
        for name, kind in self.attrs:
            if not isinstance(getattr(obj, name, None), kind):
                return f"{_describe(obj)} without a {kind.__name__} attribute {name}"
        for name, kind in self.optional:
            if hasattr(obj, name) and not isinstance(getattr(obj, name), kind):
                return f"{_describe(obj)} whose {name} is a {type(getattr(obj, name)).__name__}, not a {kind.__name__}"
        return None


def _takes(fn, n: int) -> bool:
    """Whether fn can be called with n positional arguments (True when its signature is unknown)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): the call itself will tell
        return True
    return True


def _count(n: int) -> str:
    return f"{n} positional argument{'' if n == 1 else 's'}"


def _params(fn) -> str:
    """'(a, b, *args)': the parameter names of fn's signature, without annotations or defaults."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return "(?)"
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return "(" + ", ".join(stars.get(p.kind, "") + p.name for p in params) + ")"


def _describe(obj) -> str:
    if inspect.isclass(obj):
        return f"class {obj.__name__}"
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return f"function {obj.__name__}{_params(obj)}"
    return _a(type(obj).__name__)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


class Registry(MutableMapping, Generic[T]):
    """name -> object for one kind of extension; also resolves 'package.module:name' import paths.

    A mapping (``"grpo" in LOSSES``, ``LOSSES["grpo"]``, ``del LOSSES[name]``); every object put in it
    is checked against the kind's Shape, built-ins included, so a built-in is an example of the
    interface a fork implements.
    """

    def __init__(
        self, kind: str, flag: str, shape: Shape, *, error: type[ExtensionError] = ExtensionError, also: str = ""
    ):
        """kind: the noun in messages ('loss'); flag: the command-line flag ('--train.loss');
        error: the ExtensionError subclass raised; also: other accepted forms, for the message of an
        unknown name (e.g. 'a .jsonl / .parquet file')."""
        self.kind, self.flag, self.shape, self.error, self.also = kind, flag, shape, error, also
        self._entries: dict[str, T] = {}

    # ---- the mapping -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __setitem__(self, name: str, obj: T) -> None:
        if not name or ":" in name:
            raise ValueError(
                f"{self.kind} name {name!r}: a registered name is non-empty and has no ':' (that marks an import path)"
            )
        problem = self.shape.problem(obj)
        if problem:
            raise TypeError(f"{self.kind} {name!r} is {problem}; {_a(self.kind)} is {self.shape.text}")
        self._entries[name] = obj

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make ``obj`` available as ``FLAG name`` (checked against the shape now)."""

        def deco(obj: T) -> T:
            self[name] = obj
            return obj

        return deco

    # ---- resolution --------------------------------------------------------------------------
    def resolve(self, spec: str) -> T:
        """The object a registered name or an import path 'package.module:name' names; ExtensionError if none fits."""
        if spec in self._entries:
            return self._entries[spec]
        if ":" not in spec:
            also = f", {self.also}" if self.also else ""
            self._fail(
                spec,
                f"is not a registered {self.kind} ({', '.join(sorted(self._entries))}){also} nor an "
                f"import path {IMPORT_PATH}",
                sep=" ",
            )
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            self._fail(spec, f"an import path must look like {IMPORT_PATH}")
        refusal = import_refusal(module_name)
        if refusal:
            self._fail(spec, refusal)
        try:
            obj = importlib.import_module(module_name)
        except Exception as e:  # a user module may raise anything while importing
            self._fail(
                spec,
                f"cannot import module {module_name!r} ({type(e).__name__}: {one_line(e)}); check the "
                f"name and that its folder is on PYTHONPATH",
            )
        for part in attr.split("."):
            if not hasattr(obj, part):
                self._fail(spec, f"module {module_name!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        problem = self.shape.problem(obj)
        if problem:
            self._fail(spec, f"{attr!r} is {problem}")
        return obj

    def _fail(self, spec: str, what: str, sep: str = ": "):
        raise self.error(f"{self.flag}={spec!r}{sep}{what}; {_a(self.kind)} is {self.shape.text}")


# ---- where an import path may come from ---------------------------------------------------------


def protect_folders(*folders: str) -> None:
    """Refuse, in this process and the ones it starts, any extension module under these folders
    (a run folder, the folder of run folders): a file planted there never runs as code."""
    roots = protected_folders() | {os.path.realpath(f) for f in folders if f}
    os.environ[PROTECTED_ENV] = os.pathsep.join(sorted(roots))


def protected_folders() -> set[str]:
    return {p for p in os.environ.get(PROTECTED_ENV, "").split(os.pathsep) if p}


def _find_spec(fullname: str, path) -> tuple[str | None, list[str]] | None:
    """(origin file or None, search locations) of the spec the import system would use for
    ``fullname`` (``path``: the parent package's locations, None at the top), from its own finders;
    runs no module code. The path-based finder is walked entry by entry (pkgutil.get_importer), as
    PathFinder does, because PathFinder itself needs a namespace parent to be imported already."""
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            found = _find_on_path(fullname, sys.path if path is None else path)
        else:
            find = getattr(finder, "find_spec", None)
            try:
                spec = find(fullname, path) if find is not None else None
            except Exception:  # a third-party finder may raise anything; it then provides nothing
                spec = None
            found = None if spec is None else _where(spec)
        if found is not None:
            return found
    return None


def _where(spec) -> tuple[str | None, list[str]]:
    return (spec.origin if spec.has_location else None), list(spec.submodule_search_locations or [])


def _find_on_path(fullname: str, entries) -> tuple[str | None, list[str]] | None:
    """A module or regular package found first in ``entries`` wins; else every namespace portion."""
    import pkgutil

    portions: list[str] = []
    for entry in list(entries):
        try:
            finder = pkgutil.get_importer(entry)
            spec = finder.find_spec(fullname) if finder is not None else None
        except Exception:
            continue
        if spec is None:
            continue
        if spec.loader is not None:
            return _where(spec)
        portions += list(spec.submodule_search_locations or [])
    return (None, portions) if portions else None


def module_files(name: str) -> list[str] | None:
    """Every file and folder an import of ``name`` would run or search (each package level's
    ``__init__``, the module itself, every namespace portion), located through the import system's
    finders without running anything; None when no finder provides the module."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    out: list[str] = []
    path = None
    for i in range(len(parts)):
        fullname = ".".join(parts[: i + 1])
        module = sys.modules.get(fullname)
        if module is not None:
            origin = getattr(module, "__file__", None)
            locations = list(getattr(module, "__path__", None) or [])
        else:
            found = _find_spec(fullname, path)
            if found is None:
                return None
            origin, locations = found
        out += [p for p in (origin, *locations) if isinstance(p, str) and p]
        path = locations or None
        if path is None and i < len(parts) - 1:
            return None  # a plain module cannot have submodules
    return out


def _inside(path: str, root: str) -> bool:
    root = root.rstrip(os.sep) or os.sep
    return path == root or path.startswith(root + os.sep) or root == os.sep


def _run_folder_of(path: str) -> str | None:
    """The run folder (a folder holding run.lock) that ``path`` lies in, if any."""
    folder = os.path.dirname(path) if not os.path.isdir(path) else path
    while True:
        if os.path.isfile(os.path.join(folder, RUN_FOLDER_MARK)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def import_refusal(module_name: str, also_under: tuple[tuple[str, str], ...] = ()) -> str | None:
    """Why ``module_name`` must not be imported (a phrase), or None: some file or folder of it lies in
    a run folder, under a protected folder, or under one of ``also_under`` ((folder, what it is),
    e.g. the working directory for a spec read back from a saved config). Checked on the path as
    found and with symlinks resolved."""
    files = module_files(module_name)
    if not files:
        return None  # nothing will be imported from a file: the import itself will say it is missing
    roots = [(r, "the protected folder") for r in sorted(protected_folders())]
    roots += [(os.path.realpath(r), what) for r, what in also_under]
    for found in files:
        for path in {os.path.abspath(found), os.path.realpath(found)}:
            run_folder = _run_folder_of(path)
            if run_folder is not None:
                return (
                    f"module {module_name!r} lies in the run folder {run_folder} ({path}): code is never "
                    f"imported from a run folder"
                )
            for root, what in roots:
                if _inside(path, root):
                    why = (
                        " (a run folder or --log.run-dir): code is never imported from a run folder"
                        if what == "the protected folder"
                        else ""
                    )
                    return f"module {module_name!r} lies under {what} {root} ({path}){why}"
    return None
