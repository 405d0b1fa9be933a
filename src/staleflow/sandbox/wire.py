"""Plain data between the two processes of a code-with-tests run, INSIDE the sandbox (never imported
by staleflow; standard library only).

The tests run in the harness (harness.py), which never runs the solution's code; the solution runs in
another process (runner.py, serve mode). A call from a test to a solution's function crosses as a
message; what crosses is plain data only, decoded by the receiver into objects of its own:

    None, bool, int, float, str           as JSON (a non-finite float as {"f": "nan"})
    list                                  a JSON array
    tuple, set, frozenset, dict           {"t": [...]}, {"s": [...]}, {"fs": [...]}, {"d": [[k, v], ...]}
    bytes, bytearray, complex, range      {"b": hex}, {"ba": hex}, {"c": [re, im]}, {"r": [start, stop, step]}
    a function or class of the solution   {"fn": handle}: the harness calls it through the pipe

Exact types only (a subclass of int or list, an object with its own __eq__, does not cross), at most
MAX_DEPTH levels, at most MAX_MESSAGE bytes a message. Messages are a 4-byte length and UTF-8 JSON.
"""

import json
import math
import os
import struct

MAX_MESSAGE = 16 << 20
MAX_DEPTH = 64
_SCALARS = (type(None), bool, int, str)


class WireError(ValueError):
    """A value that is not plain data, or a message that does not decode."""


class RemoteFunction:
    """In the harness: a function of the solution's process, called through ``call(handle, args, kwargs)``."""

    __slots__ = ("handle", "_call")

    def __init__(self, handle: int, call):
        self.handle, self._call = handle, call

    def __call__(self, *args, **kwargs):
        return self._call(self.handle, args, kwargs)

    def __repr__(self) -> str:
        return f"<solution function {self.handle}>"


def encode(value, handles=None, depth: int = 0):
    """``value`` as JSON-able plain data; a callable becomes a handle in ``handles`` (id -> object)
    when given, else WireError."""
    if depth > MAX_DEPTH:
        raise WireError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"f": repr(value)}
    nested = depth + 1
    if kind is list:
        return [encode(v, handles, nested) for v in value]
    if kind is tuple:
        return {"t": [encode(v, handles, nested) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, handles, nested), encode(v, handles, nested)] for k, v in value.items()]}
    if kind in (set, frozenset):
        return {"s" if kind is set else "fs": [encode(v, handles, nested) for v in value]}
    if kind in (bytes, bytearray):
        return {"b" if kind is bytes else "ba": bytes(value).hex()}
    if kind is complex:
        return {"c": [encode(value.real, None, nested), encode(value.imag, None, nested)]}
    if kind is range:
        return {"r": [value.start, value.stop, value.step]}
    if kind is RemoteFunction:
        return {"fn": value.handle}
    if handles is not None and callable(value) and (isinstance(value, type) or hasattr(value, "__code__")):
        handles[id(value)] = value  # kept alive here, so the id stays this object's
        return {"fn": id(value)}
    raise WireError(f"a {kind.__name__} (not plain data)")


def decode(obj, remote=None):
    """Plain data from ``encode``'s form; ``remote(handle)`` builds the object standing for a
    function handle (None: handles are refused). WireError for anything else."""
    try:
        return _decode(obj, remote, 0)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:  # an unhashable key, bad hex, ...
        raise WireError(f"a value that does not decode ({type(e).__name__}: {e})") from None


def _decode(obj, remote, depth: int):
    if depth > MAX_DEPTH:
        raise WireError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(obj)
    if kind in _SCALARS or kind is float:
        return obj
    nested = depth + 1
    if kind is list:
        return [_decode(v, remote, nested) for v in obj]
    if kind is not dict or len(obj) != 1:
        raise WireError(f"not an encoded value: a {kind.__name__}")
    ((tag, body),) = obj.items()
    if tag == "f" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag in ("t", "s", "fs", "d") and type(body) is list:
        items = [_decode(v, remote, nested) for v in body]
        if tag == "t":
            return tuple(items)
        if tag == "d":
            if not all(type(p) is list and len(p) == 2 for p in items):
                raise WireError("a dict's items are [key, value] pairs")
            return dict(items)
        return set(items) if tag == "s" else frozenset(items)
    if tag in ("b", "ba") and type(body) is str:
        data = bytes.fromhex(body)
        return data if tag == "b" else bytearray(data)
    if tag == "c" and type(body) is list and len(body) == 2:
        re, im = (_decode(v, None, nested) for v in body)
        if type(re) is not float or type(im) is not float:
            raise WireError("a complex number is two floats")
        return complex(re, im)
    if tag == "r" and type(body) is list and len(body) == 3 and all(type(v) is int for v in body):
        return range(*body)
    if tag == "fn" and type(body) is int and remote is not None:
        return remote(body)
    raise WireError(f"unknown or malformed tag {tag!r}")


def send(fd: int, message) -> None:
    data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if len(data) > MAX_MESSAGE:
        raise WireError(f"a message of {len(data)} bytes > {MAX_MESSAGE}")
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other process closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(fd: int):
    """One message; EOFError when the writer is gone, WireError for one that does not decode."""
    (n,) = struct.unpack(">I", _read(fd, 4))
    if n > MAX_MESSAGE:
        raise WireError(f"a message of {n} bytes > {MAX_MESSAGE}")
    try:
        return json.loads(_read(fd, n).decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError) as e:
        raise WireError(f"a message that is not JSON ({type(e).__name__})") from None
