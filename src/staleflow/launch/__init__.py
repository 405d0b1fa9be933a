"""staleflow.launch."""
