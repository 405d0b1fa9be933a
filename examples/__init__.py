"""Worked forks of StaleFlow: a loss (cispo.py), an advantage estimator (rank_advantage.py) and a
routing strategy (kv_router.py), each selected by import path (docs/extending.md). Run from the
repository root (``./launch.sh`` runs there), where ``examples`` is importable as it is."""
