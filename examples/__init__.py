"""Worked forks of StaleFlow: a loss (cispo.py), an advantage estimator (rank_advantage.py) and a
routing strategy (kv_router.py), each selected by import path (docs/extending.md). Run from the
repository root with the checkout on the import path, as each module's command shows
(``PYTHONPATH=$PWD ./launch.sh ...``): no StaleFlow process puts the working directory there itself."""
