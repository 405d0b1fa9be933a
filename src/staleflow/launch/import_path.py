"""The import path of every StaleFlow process: the working directory never comes before an installed package.

``python -m``, ``python -c``, torchrun's workers (``python -u -m staleflow train``) and ``python -m pytest``
put the working directory FIRST on sys.path, where any folder in it shadows an installed package of
the same name: the repository's ``kernels/`` hid Hugging Face's ``kernels``, which transformers >= 5.25
imports, and every tokenizer load failed. Each entry point (``staleflow.cli.main``: ``python -m
staleflow``, the ``staleflow`` script, torchrun's workers; ``python -m staleflow.launch.torchrun``) calls
:func:`working_directory_last` before it imports anything that could import transformers, and launch.sh
exports ``PYTHONSAFEPATH=1`` (Python >= 3.11's ``-P``):

- ``PYTHONSAFEPATH=1`` goes into the environment, so every Python process started from here (torchrun's
  workers, multiprocessing's spawned children, a script run by a test) starts without it;
- the working directory is taken off the front of sys.path and appended LAST: a module of your own
  there (``--train.loss examples.cispo:cispo_loss``, docs/extending.md) still imports, but nothing in
  it can hide an installed package.
"""

from __future__ import annotations

import os
import sys


def working_directory_last() -> None:
    """Move the working directory from the front of sys.path to its end (idempotent)."""
    os.environ["PYTHONSAFEPATH"] = "1"
    cwd = os.getcwd()
    if not sys.flags.safe_path and sys.path and os.path.abspath(sys.path[0] or ".") == cwd:
        del sys.path[0]  # what python -m / -c inserted
    if cwd not in sys.path:
        sys.path.append(cwd)
