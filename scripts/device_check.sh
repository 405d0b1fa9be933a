#!/usr/bin/env bash
# One GPU run for the fused log-prob/entropy kernels (issue 7): correctness on real shapes, then
# the benchmark (forward and forward+backward vs the chunked PyTorch path and the naive path);
# then the rollout engine's paged decode attention kernel (check + timing) and engine GPU tests.
#   bash scripts/device_check.sh            # from anywhere; runs from the repo root
# Needs: CUDA, torch, triton (3.6+), numpy. Optional: pytest (+hypothesis). No tyro, no network,
# no pip install: staleflow and staleflow.kernels are imported from this checkout via a symlink
# shim on PYTHONPATH. Logs go to $OUT (when set) and stdout; each step's last line is JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0   # real kernels; tests/conftest.py only sets it when unset
LOG_DIR="${OUT:-/tmp}"
mkdir -p "$LOG_DIR"

SHIM="$(mktemp -d)"
mkdir "$SHIM/staleflow"
for f in "$PWD"/src/staleflow/*; do ln -s "$f" "$SHIM/staleflow/"; done
# src/staleflow/kernels is itself a symlink now; linking again would land inside kernels/
[ -e "$SHIM/staleflow/kernels" ] || ln -s "$PWD/kernels" "$SHIM/staleflow/kernels"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi -L || true
python -c "import sys, torch, triton, staleflow.kernels.logprob as k; \
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available(), 'triton_available', k.triton_available())" || exit 2

tests_status=pass
if python -c "import pytest" 2>/dev/null; then
    files="tests/test_kernels.py tests/test_kernels_gpu.py"
    python -c "import hypothesis" 2>/dev/null && files="$files tests/test_kernels_props.py"
    timeout 300 python -m pytest -q -s -p no:cacheprovider $files 2>&1 | tee "$LOG_DIR/kernels_tests.log" \
        || tests_status=fail
else
    echo "# pytest missing: running the GPU checks directly"
    timeout 300 python tests/test_kernels_gpu.py 2>&1 | tee "$LOG_DIR/kernels_tests.log" || tests_status=fail
fi

timeout 420 python scripts/bench_kernels.py --sweep --tests-status "$tests_status" 2>&1 \
    | tee "$LOG_DIR/bench_kernels.log"
bench_rc=${PIPESTATUS[0]}

# Rollout engine decode: the Triton paged decode attention kernel at real shapes (batch 64 x 8k
# context, Qwen2.5-7B heads 28 q / 4 kv, head_dim 128, bf16) against the fp64 reference, bitwise
# batch invariance, fp32/fp16 at smaller shapes; then timed against the gather + SDPA path it
# replaces (and flash-attn when installed) with a small tile sweep. No pytest needed; last line JSON.
timeout 300 python tests/test_kernels_paged_decode_gpu.py 2>&1 | tee "$LOG_DIR/paged_decode.log"
decode_rc=${PIPESTATUS[0]}
# The built-in engine on CUDA (auto = paged kernel vs gather under churn, fp32 logits of a bf16
# engine, greedy vs transformers): needs pytest, hypothesis (conftest) and transformers.
engine_status=skipped
if python -c "import pytest, hypothesis, transformers" 2>/dev/null; then
    engine_status=pass
    timeout 300 python -m pytest -q -s -p no:cacheprovider tests/test_engine_gpu.py 2>&1 \
        | tee "$LOG_DIR/engine_gpu_tests.log" || engine_status=fail
fi
echo "{\"paged_decode_rc\": $decode_rc, \"engine_gpu_tests\": \"$engine_status\"}"
rm -rf "$SHIM"
[ "$tests_status" = pass ] && [ "$bench_rc" = 0 ] && [ "$decode_rc" = 0 ] && [ "$engine_status" != fail ]
