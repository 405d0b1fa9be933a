"""staleflow.sim."""
