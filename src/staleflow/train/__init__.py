"""staleflow.train."""
