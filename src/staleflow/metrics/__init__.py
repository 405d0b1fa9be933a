"""staleflow.metrics."""
