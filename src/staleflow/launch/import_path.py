"""The import path of every StaleFlow process: the working directory is never on it.

``python -m``, ``python -c``, torchrun's workers (``python -u -m staleflow train``) and ``python -m pytest``
put the working directory FIRST on sys.path, where any folder in it shadows an installed package of
the same name (the repository's ``kernels/`` hid Hugging Face's ``kernels``, which transformers >= 5.25
imports, and every tokenizer load failed) and any module in it, a run folder's planted ``payload.py``
included, can be named by an import path. Each entry point (``staleflow.cli.main``: ``python -m
staleflow``, the ``staleflow`` script, torchrun's workers; ``python -m staleflow.launch.torchrun``) calls
:func:`working_directory_off` before it imports anything that could import transformers, and launch.sh
exports ``PYTHONSAFEPATH=1`` (Python >= 3.11's ``-P``):

- ``PYTHONSAFEPATH=1`` goes into the environment, so every Python process started from here (torchrun's
  workers, multiprocessing's spawned children, a script run by a test) starts without it;
- the entry the interpreter inserted for the working directory is removed. A module of your own is
  named on purpose: ``PYTHONPATH=$PWD ./launch.sh --train.loss examples.cispo:cispo_loss`` (an explicit
  PYTHONPATH entry is kept), or install your package (docs/extending.md).
"""

from __future__ import annotations

import os
import sys


def working_directory_off() -> None:
    """Take the working directory the interpreter put in front of sys.path off it (idempotent)."""
    os.environ["PYTHONSAFEPATH"] = "1"
    if not sys.flags.safe_path and sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
        del sys.path[0]  # what python -m / -c inserted; an explicit PYTHONPATH entry comes later and stays
