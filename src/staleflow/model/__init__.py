"""staleflow.model."""
