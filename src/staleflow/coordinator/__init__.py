"""staleflow.coordinator."""
