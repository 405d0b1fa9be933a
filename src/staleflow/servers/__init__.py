"""staleflow.servers."""
