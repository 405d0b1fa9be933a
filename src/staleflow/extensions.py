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
no torch, no I/O beyond importing the module a spec names. docs/extending.md lists every kind.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from staleflow.faults import ConfigError

T = TypeVar("T")
IMPORT_PATH = "'package.module:name'"


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
