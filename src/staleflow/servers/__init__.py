"""StaleFlow data plane: the Trajectory Server rings and the Parameter Server slots.

Bytes live in shared memory (or on a GPU, shared by CUDA IPC); the controller only ever
holds small handles (``RecordHandle``) and version numbers. See docs/servers.md.
"""

from staleflow.servers.errors import (
    RecordTooLarge,
    RingFull,
    SegmentError,
    ServerError,
    StaleHandle,
    TornRead,
    VersionNotFound,
)
from staleflow.servers.layout import ParamEntry, ParamLayout
from staleflow.servers.parameter import ParameterServer
from staleflow.servers.segment import cleanup_stale_segments, list_segments
from staleflow.servers.trajectory import TrajectoryRing, record_nbytes
from staleflow.servers.transport import broadcast_pull
from staleflow.trajectory import RecordHandle

__all__ = [
    "ParamEntry",
    "ParamLayout",
    "ParameterServer",
    "RecordHandle",
    "RecordTooLarge",
    "RingFull",
    "SegmentError",
    "ServerError",
    "StaleHandle",
    "TornRead",
    "TrajectoryRing",
    "VersionNotFound",
    "broadcast_pull",
    "cleanup_stale_segments",
    "list_segments",
    "record_nbytes",
]
