"""staleflow.protocol."""
