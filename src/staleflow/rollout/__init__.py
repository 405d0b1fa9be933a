"""staleflow.rollout."""
