"""Typed control-plane messages between the controller and the ranks (msgpack via msgspec, no pickle).

Every message is a tagged msgspec Struct; `encode`/`decode` round-trip the union `Message`.
Bytes of trajectories and weights never travel here: only handles, commands and stats.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class Register(msgspec.Struct, tag=True):
    """A rank announces itself as soon as it starts (so the controller can watch its pid)."""

    rank: int
    role: str
    pid: int
    host: str
    info: dict[str, Any] = {}


class Ready(msgspec.Struct, tag=True):
    """A rank finished its set-up (model loaded, servers attached)."""

    rank: int
    info: dict[str, Any] = {}


class Welcome(msgspec.Struct, tag=True):
    """Controller -> rank: registration accepted; the run may start."""

    run_id: str
    world_size: int


class Heartbeat(msgspec.Struct, tag=True):
    rank: int


class Failure(msgspec.Struct, tag=True):
    """A rank hit an error it cannot recover from; the controller stops the run."""

    rank: int
    error: str


class Shutdown(msgspec.Struct, tag=True):
    """Controller -> rank: stop now (ok=False: the run failed)."""

    reason: str
    ok: bool = True


class Goodbye(msgspec.Struct, tag=True):
    """Rank -> controller: leaving (after a Shutdown or on a signal)."""

    rank: int
    ok: bool = True
    reason: str = ""


class Ping(msgspec.Struct, tag=True):
    """Round-trip probe used by the smoke run and tests."""

    rank: int
    seq: int
    payload: str = ""


class Pong(msgspec.Struct, tag=True):
    seq: int
    payload: str = ""


_TYPES: list[type] = [Register, Ready, Welcome, Heartbeat, Failure, Shutdown, Goodbye, Ping, Pong]
_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder | None = None


def register_message(cls: type) -> type:
    """Add a tagged Struct to the control-plane union (runtime modules register their own)."""
    global _decoder
    if cls not in _TYPES:
        _TYPES.append(cls)
        _decoder = None
    return cls


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> msgspec.Struct:
    global _decoder
    if _decoder is None:
        _decoder = msgspec.msgpack.Decoder(Union[tuple(_TYPES)])  # type: ignore[valid-type]
    return _decoder.decode(data)
