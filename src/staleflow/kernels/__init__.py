"""Triton kernels: packed varlen log-prob + entropy fused with the LM head, paged decode attention.

The sources live in the repository's top-level ``kernels/`` folder (the design's layout); each module
here is a symlink to its file there, so they import as ``staleflow.kernels.<name>``. The top-level
folder is deliberately NOT a package (no ``__init__.py``): ``python -m``, torchrun and pytest put the
working directory first on sys.path, and a regular package named ``kernels`` there would shadow
Hugging Face's ``kernels``, which transformers >= 5.25 imports. A directory without ``__init__.py``
is only a namespace portion, which any installed package of that name beats. A new kernel file needs
its symlink here (tests/test_layout.py checks that every one has it).
"""
