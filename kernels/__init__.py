"""Triton kernels (installed as staleflow.kernels): packed varlen log-prob + entropy fused with the LM head."""
