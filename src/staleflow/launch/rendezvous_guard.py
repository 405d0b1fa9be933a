"""The torchrun agent's rendezvous state, decoded without running code.

torch's c10d dynamic rendezvous keeps its state (round, participants, heartbeats) PICKLED in an
unauthenticated TCPStore (key ``torch.rendezvous.<run id>``) and every agent ``pickle.loads`` what
it reads there (``_BackendRendezvousStateHolder.sync`` in ``dynamic_rendezvous.py``; the only
unpickling of store data in ``torch.distributed.elastic``: the agent's rank assignment and barriers
use JSON and plain bytes). Any process that reaches the store's port could run code in the agent.

``install()`` (called by ``staleflow.launch.torchrun`` before the agent starts) gives that module a
``pickle`` whose ``loads`` admits only the rendezvous' own types (``_RendezvousState``,
``_NodeDesc``, ``datetime``/``timezone``/``timedelta``) and builtins' containers, then checks the
decoded state field by field. Anything else raises torch's own ``RendezvousStateError`` with one
line naming the key, so the agent stops instead of executing it. Writing stays ``pickle.dumps``:
agents of a plain torchrun on other nodes read it as before.

If a torch release moves that unpickling elsewhere, ``install()`` refuses to start (fail closed)
rather than leave it unguarded: it checks that ``sync`` still reads ``pickle.loads`` from the module.
"""

from __future__ import annotations

import io
import pickle
import sys
from datetime import datetime

DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
ALLOWED = {
    (DYNAMIC, "_RendezvousState"),
    (DYNAMIC, "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "dict"),
    ("builtins", "list"),
    ("builtins", "tuple"),
}
"""(module, name) pairs the rendezvous state may name: nothing that runs code when called."""
MAX_STATE_BYTES = 16 << 20


class UnsafeRendezvousState(pickle.UnpicklingError):
    """The store held something other than torch's rendezvous state."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise UnsafeRendezvousState(f"it names {module}.{name}, which is not a rendezvous type")
        return getattr(sys.modules[module] if module in sys.modules else __import__(module), name)

    def persistent_load(self, pid):
        raise UnsafeRendezvousState("it holds a persistent reference")


def _check_time(value, where: str) -> None:
    if type(value) is not datetime or value.tzinfo is None:
        raise UnsafeRendezvousState(f"{where} is not a timezone-aware datetime")


def _check_node(node, cls, where: str) -> None:
    if type(node) is not cls:
        raise UnsafeRendezvousState(f"{where} holds a {type(node).__name__}, not a node descriptor")
    fields = vars(node)
    if set(fields) != {"addr", "pid", "local_id"}:
        raise UnsafeRendezvousState(f"a node descriptor in {where} has fields {sorted(fields)}")
    if not isinstance(node.addr, str) or len(node.addr) > 1024:
        raise UnsafeRendezvousState(f"a node address in {where} is not a short string")
    for key in ("pid", "local_id"):
        value = fields[key]
        if type(value) is not int or not 0 <= value < 1 << 63:
            raise UnsafeRendezvousState(f"a node's {key} in {where} is not an int in [0, 2**63)")


def check_state(state, dynamic) -> None:
    """Raise UnsafeRendezvousState unless ``state`` has the fields and types of a fresh state."""
    state_cls, node_cls = dynamic._RendezvousState, dynamic._NodeDesc
    if type(state) is not state_cls:
        raise UnsafeRendezvousState(f"it decodes to a {type(state).__name__}, not a rendezvous state")
    fresh, got = vars(state_cls()), vars(state)
    if set(got) != set(fresh):
        raise UnsafeRendezvousState(f"its fields {sorted(got)} are not {sorted(fresh)}")
    for key, value in got.items():
        default = fresh[key]
        if key == "deadline":
            if value is not None:
                _check_time(value, "its deadline")
        elif isinstance(default, (set, frozenset)):
            if type(value) is not type(default):
                raise UnsafeRendezvousState(f"its {key} is not a {type(default).__name__}")
            for node in value:
                _check_node(node, node_cls, key)
        elif isinstance(default, dict):
            if type(value) is not dict:
                raise UnsafeRendezvousState(f"its {key} is not a dict")
            for node, item in value.items():
                _check_node(node, node_cls, key)
                if type(item) is datetime:
                    _check_time(item, f"a value in {key}")
                elif type(item) is not int or not 0 <= item < 1 << 31:
                    raise UnsafeRendezvousState(f"a value in {key} is not a rank in [0, 2**31) or a time")
        elif type(value) is not type(default):
            raise UnsafeRendezvousState(f"its {key} is a {type(value).__name__}, not a {type(default).__name__}")
        elif type(value) is int and not 0 <= value < 1 << 63:
            raise UnsafeRendezvousState(f"its {key} is out of range")


def safe_loads(data: bytes, dynamic=None):
    """Decode a rendezvous state read from the store; UnsafeRendezvousState for anything else."""
    if dynamic is None:
        dynamic = sys.modules[DYNAMIC]
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_STATE_BYTES:
        raise UnsafeRendezvousState("it is not a byte string under 16 MiB")
    try:
        state = _Unpickler(io.BytesIO(bytes(data))).load()
    except UnsafeRendezvousState:
        raise
    except Exception as e:  # a truncated or malformed pickle: every decoding error is the same answer
        raise UnsafeRendezvousState(f"it does not decode ({type(e).__name__})") from None
    check_state(state, dynamic)
    return state


class _GuardedPickle:
    """Stands in for the ``pickle`` module inside dynamic_rendezvous: dumps as before, loads guarded."""

    PickleError = pickle.PickleError
    UnpicklingError = pickle.UnpicklingError
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
    DEFAULT_PROTOCOL = pickle.DEFAULT_PROTOCOL
    dumps = staticmethod(pickle.dumps)

    def __init__(self, key_hint: str):
        self.key_hint = key_hint
        self.refused = 0

    def loads(self, data, *args, **kwargs):
        try:
            return safe_loads(data)
        except UnsafeRendezvousState as e:
            self.refused += 1
            if self.refused > 1:  # said once; the agent then stops (or retries) on the same state
                raise
            line = (
                f"staleflow: refused the rendezvous state in the store ({self.key_hint}): {e}; another process "
                f"wrote it (nothing was executed). Stop that process, or keep the store's port private"
            )
            print(line, file=sys.stderr, flush=True)
            raise

    def __getattr__(self, name):  # anything else dynamic_rendezvous might use, except loading
        if name in ("load", "Unpickler", "_loads", "_load", "_Unpickler"):
            raise AttributeError(f"staleflow: pickle.{name} is not available to the rendezvous")
        return getattr(pickle, name)


class GuardError(RuntimeError):
    """This torch's rendezvous does not unpickle where the guard expects: refuse to start."""


def install(key_hint: str = "key torch.rendezvous.<run id>") -> _GuardedPickle:
    """Replace ``pickle`` in torch's dynamic rendezvous by the guarded one; GuardError if this torch
    unpickles its state some other way (the guard would then not cover it)."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic

    holder = getattr(dynamic, "_BackendRendezvousStateHolder", None)
    sync = getattr(holder, "sync", None)
    code = getattr(sync, "__code__", None)
    current = getattr(dynamic, "pickle", None)
    if isinstance(current, _GuardedPickle):
        return current
    if code is None or current is not pickle or not {"pickle", "loads"} <= set(code.co_names):
        raise GuardError(
            "this torch's rendezvous does not decode its state with dynamic_rendezvous.pickle.loads, which "
            "staleflow.launch.torchrun guards: use a torch release in 2.11-2.13"
        )
    unguarded = [
        name
        for name, value in vars(dynamic).items()
        if value in (pickle.loads, pickle.load, pickle.Unpickler) and name != "pickle"
    ]
    if unguarded:
        raise GuardError(f"this torch's rendezvous imports {unguarded} from pickle directly: not guarded")
    guarded = _GuardedPickle(key_hint)
    dynamic.pickle = guarded
    return guarded


__all__ = ["ALLOWED", "GuardError", "UnsafeRendezvousState", "check_state", "install", "safe_loads"]
