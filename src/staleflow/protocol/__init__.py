"""staleflow.protocol: batch protocols (which groups may start, which batch the trainer gets), pure Python.

``StalenessManager`` is StaleFlow's per-trajectory Reserve / Occupy / Consume; ``AReaLBuffer`` and
``VerlAsyncBuffer`` are the count-based rules of the asynchronous peers. All implement
``interface.BatchProtocol``; ``make_protocol(name, spec)`` builds one by name from a ``StalenessSpec`` (the six settings every
protocol shares) (the resolved mode
names it, coordinator/modes.py).
"""

from staleflow.protocol.areal import AReaLBuffer
from staleflow.protocol.counted import CountedBuffer
from staleflow.protocol.staleness import StalenessManager
from staleflow.protocol.types import BufferState, EntryState, ProtocolError, StalenessSpec
from staleflow.protocol.verl import VerlAsyncBuffer

PROTOCOLS = {"staleflow": StalenessManager, "areal": AReaLBuffer, "verl-fully-async": VerlAsyncBuffer}


def make_protocol(name: str, spec: StalenessSpec, **options):
    """The batch protocol `name` (a PROTOCOLS key) with the staleness settings and its own options."""
    if name not in PROTOCOLS:
        raise ProtocolError(f"protocol {name!r} is unknown; choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name](spec, **options)


__all__ = [
    "AReaLBuffer",
    "BufferState",
    "CountedBuffer",
    "EntryState",
    "PROTOCOLS",
    "ProtocolError",
    "StalenessManager",
    "StalenessSpec",
    "VerlAsyncBuffer",
    "make_protocol",
]
