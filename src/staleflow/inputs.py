"""Bounded readers of files that come from outside the run (data, model folders, run folders, config
files, the scripts' records): regular files only, size-capped, JSON nesting-capped.

    problem = special_file(path)                  # None, or 'is a FIFO' / 'is a character device' ...
    data = read_capped(path, 16 << 20)            # bytes; InputError (one line) otherwise
    obj = load_json(path, 16 << 20)               # a parsed JSON value; InputError otherwise
    fd = open_regular(path)                       # an fd open for reading, never on a FIFO or a device

A FIFO, a socket or a device where a file is expected is refused before anything opens it: opening a
FIFO for reading blocks until a writer comes (a check that hangs for ever), and opening some devices
has effects of its own. The type is checked with stat (symlinks followed) before the open, and again
with fstat on the descriptor, opened O_NONBLOCK, so a file swapped in between is refused too.
Callers turn InputError into their own kind of error (DataError, ModelLoadError, ConfigError...).
Pure standard library; no torch.
"""

from __future__ import annotations

import json
import os
import stat

MAX_JSON_BYTES = 16 << 20
"""A JSON file of metadata (an index, a state.json, a config) larger than this is refused."""

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class InputError(ValueError):
    """A file that is not a regular file, too large, not UTF-8 or not JSON; the message is one line."""


def _kind(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def special_file(path) -> str | None:
    """Why ``path`` must not be opened as a file ('is a FIFO (named pipe)', 'does not exist', ...), or None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    kind = _kind(mode)
    return f"is {kind}, not a regular file" if kind else None


def open_regular(path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of ``path`` opened for reading; InputError for anything but a regular file (checked
    before the open, and on the descriptor itself)."""
    problem = special_file(path)
    if problem:
        raise InputError(f"{path} {problem}")
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise InputError(f"{path} cannot be opened ({e.strerror})") from None
    kind = _kind(os.fstat(fd).st_mode)
    if kind:
        os.close(fd)
        raise InputError(f"{path} is {kind}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_capped(path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; InputError otherwise."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise InputError(f"{path} holds {size} bytes, more than the {limit} such a file may")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise InputError(f"{path} holds more than the {limit} bytes such a file may")
        return b"".join(chunks)
    finally:
        os.close(fd)


def load_json(path, limit: int = MAX_JSON_BYTES):
    """The JSON value of a regular file of at most ``limit`` bytes; InputError (invalid UTF-8, invalid
    JSON, nested too deeply for the parser) otherwise."""
    data = read_capped(path, limit)
    return loads_json(data, str(path))


def loads_json(data: bytes | str, name: str):
    """json.loads with every failure one InputError naming ``name`` (RecursionError included)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise InputError(f"{name} is not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{name} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise InputError(f"{name} is nested too deeply to be read") from None
    except ValueError as e:  # a number too long to convert, ...
        raise InputError(f"{name} is not valid JSON ({' '.join(str(e).split())[:120]})") from None


def depth_within(value, limit: int) -> bool:
    """Whether a parsed JSON value nests at most ``limit`` containers deep (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return False
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True
