"""staleflow.protocol: batch protocols (which groups may start, which batch the trainer gets), pure Python.

``StalenessManager`` is StaleFlow's per-trajectory Reserve / Occupy / Consume; ``CountedBuffer`` is the
shared base of the peers' count-based rules (each peer's own rule lives in its mode's file, staleflow.modes:
``AReaLBuffer`` in modes/areal.py, ``VerlAsyncBuffer`` in modes/verl.py). All implement
``interface.BatchProtocol``; a mode builds its protocol from a ``StalenessSpec`` (the six settings every
protocol shares) and its own settings (``Mode.protocol``).
"""

from staleflow.protocol.counted import CountedBuffer
from staleflow.protocol.staleness import StalenessManager
from staleflow.protocol.types import BufferState, EntryState, ProtocolError, StalenessSpec

__all__ = ["BufferState", "CountedBuffer", "EntryState", "ProtocolError", "StalenessManager", "StalenessSpec"]
