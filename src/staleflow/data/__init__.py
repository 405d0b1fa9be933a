"""staleflow.data."""
