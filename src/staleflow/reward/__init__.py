"""staleflow.reward."""
