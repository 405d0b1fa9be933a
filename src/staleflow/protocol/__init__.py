"""staleflow.protocol: the global staleness protocol (Reserve / Occupy / Consume), pure Python."""

from staleflow.protocol.staleness import BufferState, EntryState, ProtocolError, StalenessManager

__all__ = ["BufferState", "EntryState", "ProtocolError", "StalenessManager"]
