"""Typed control-plane messages between the controller and the ranks (msgpack via msgspec, no pickle).

Every message is a tagged msgspec Struct; `encode`/`decode` round-trip the union `Message`.
Bytes of trajectories and weights never travel here: only handles, commands and stats.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull
from staleflow.trajectory import Finished, RecordHandle, Route, TrainGroup


class Register(msgspec.Struct, tag=True):
    """A rank announces itself as soon as it starts (so the controller can watch its pid)."""

    rank: int
    role: str
    pid: int
    host: str
    info: dict[str, Any] = {}
    node: int = 0
    """torchrun's node (GROUP_RANK) of the rank; its pid means something only on that node."""


class Ready(msgspec.Struct, tag=True):
    """A rank finished its set-up (model loaded, servers attached)."""

    rank: int
    info: dict[str, Any] = {}


class Welcome(msgspec.Struct, tag=True):
    """Controller -> rank: registration accepted; the run may start."""

    run_id: str
    world_size: int


class Heartbeat(msgspec.Struct, tag=True):
    """Controller -> every rank each second (rank -1); rank -> controller each second from the
    rank's pulse thread (workers/pulse.py): a progress counter and whether the rank has work."""

    rank: int
    progress: int = 0
    busy: bool = False


class Failure(msgspec.Struct, tag=True):
    """A rank hit an error it cannot recover from; the controller stops the run."""

    rank: int
    error: str
    fatal: bool = False
    """Bad input or environment (the fault table, faults.py): restarting would fail the same way."""


class Shutdown(msgspec.Struct, tag=True):
    """Controller -> rank: stop now (ok=False: the run failed; restart: an elastic restart may fix it)."""

    reason: str
    ok: bool = True
    restart: bool = False


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
        _decoder = msgspec.msgpack.Decoder(Union[tuple(_TYPES)])  # type: ignore[valid-type]  # noqa: UP007
    return _decoder.decode(data)


# ---- training runtime (staleflow.runtime.backend <-> workers/rollout.py, workers/trainer.py) -----------
# The trajectory's forms travel as they are (staleflow/trajectory.py: Route, Finished, TrainGroup inside
# TrainStep, RecordHandle), and so do the coordinator's commands and its InstanceSnapshot.


class FreeRecords(msgspec.Struct, tag=True):
    """Controller -> the producing rollout rank: these ring records are consumed or aborted."""

    handles: list[RecordHandle]


class Pulled(msgspec.Struct, tag=True):
    """Rollout rank -> controller: weights of `version` loaded."""

    instance: int
    version: int
    seconds: float
    nbytes: int = 0
    """Weight bytes loaded; cross_node: some came over the network (a piece held on another node)."""
    cross_node: bool = False
    by_node: dict[int, int] = {}
    """Bytes of this pull by the node that held them (its own node's came from shared memory / CUDA IPC)."""
    cross_node_bytes: int = 0
    """Bytes that crossed the network (the sum of ``by_node`` over the other nodes)."""


class TrainStep(msgspec.Struct, tag=True):
    """Controller -> every trainer rank: train buffer `version` on these groups (the same for all)."""

    version: int
    groups: list[TrainGroup]


class StepDone(msgspec.Struct, tag=True):
    """Trainer leader -> controller: version `version` is published in the PS."""

    version: int
    metrics: dict[str, float]
    train_s: float
    push_s: float
    content: dict[int, list[str]] = {}
    """group id -> metrics.audit.content_digest of each member as the trainer read it (the audit trail)."""
    token_versions: dict[int, list[list[list[int]]]] = {}
    """group id -> metrics.audit.version_counts of each member's response tokens (trained.jsonl)."""


class SaveState(msgspec.Struct, tag=True):
    """Controller -> every trainer rank: save the training state (and export HF weights if export_dir).

    durable False: the leader answers ``Saved(pending=True)`` once the state is copied to host
    memory (training may go on) and a second ``Saved`` when the files are in place or failed."""

    step: int
    extra: dict[str, Any]
    export_dir: str = ""
    durable: bool = True
    """Answer only once the checkpoint is in place (a final save, a save before a stop)."""
    ticket: int = 0
    """Echoed in every Saved about this save."""


class Saved(msgspec.Struct, tag=True):
    """Trainer leader -> controller: the checkpoint of `step` is written (error: it failed, and the
    previous checkpoint is untouched)."""

    step: int
    path: str
    error: str = ""
    disk: bool = False
    """The save failed on a full, read-only or forbidden disk: the run stops (no retry fixes it)."""
    pending: bool = False
    """Only the snapshot is taken: the files are being written (another Saved follows)."""
    estimate_s: float = 0.0
    """With pending: how long writing may take (from the bytes and the last measured write speed)."""
    ticket: int = 0


_SPAN = 1 << 20


def eval_request_id(eval_id: int, index: int) -> int:
    """Engine request id of held-out prompt `index` of evaluation `eval_id` (negative: never a trajectory)."""
    return -(eval_id * _SPAN + index + 1)


def is_eval(request_id) -> bool:
    return isinstance(request_id, int) and request_id < 0


def split_eval_id(request_id: int) -> tuple[int, int]:
    k = -request_id - 1
    return k // _SPAN, k % _SPAN


class Evaluate(msgspec.Struct, tag=True):
    """Controller -> rollout rank: answer these held-out prompts greedily (alongside the rollout)."""

    eval_id: int
    indices: list[int]
    prompts: list[list[int]]
    max_new_tokens: int
    answers: list[str] = []
    metas: list[dict[str, Any]] = []
    """Multi-turn runs: each prompt's data-row answer and meta, for the environment's reset (else empty)."""


class Evaluated(msgspec.Struct, tag=True):
    """Rollout rank -> controller: one held-out answer, written to the rank's ring like a trajectory
    (the controller reads it, scores it and frees it with FreeRecords), and the weight versions it used."""

    eval_id: int
    index: int
    handle: RecordHandle
    min_version: int
    max_version: int


for _cls in (
    Route,
    Finished,
    Interrupt,
    Abort,
    Pull,
    InstanceSnapshot,
    FreeRecords,
    Pulled,
    TrainStep,
    StepDone,
    SaveState,
    Saved,
    Evaluate,
    Evaluated,
):
    register_message(_cls)
