#!/usr/bin/env bash
# One prepared GPU check of StaleFlow (issue 19), sized for ONE run of at most 10 minutes on one
# H100/H200: every step has its own timeout and the timeouts add up to 565 s. Steps:
#   1 kernels   the log-prob kernel tests at real shapes, then its benchmark (no tile sweep)
#   2 decode    the Triton paged decode kernel at real shapes (Qwen2.5-7B heads, 64 x 8k context)
#   3 engine    the built-in engine on CUDA: greedy == transformers, fp32 logits, paged == gather
#   4 trainer   a 1-rank NCCL group: FSDP2 in bf16, Triton log-probs vs chunked (step and kernel at
#               the 7B LM-head shape), peak memory beside the memory plan's estimate
#   5 ps        bf16 Parameter Server slots written by two piece owners, CUDA IPC pulls by two other
#               processes (own reader indices), bytes checked, pull GB/s, context sizes measured
#   6 run       torchrun, 2 processes on the one GPU (1 trainer + 1 rollout), tiny model, 2 steps
#   7 plan      python -m staleflow plan --preset gpu-7b for this GPU (no GPU work; the 7B table)
# Output: one table on stdout, $OUT/device_check.json (all step JSON lines) and one log per step.
#
#   bash scripts/device_check.sh            # from anywhere; runs from the repo root
#   STEPS="4 5 6" bash scripts/device_check.sh   # a subset
#
# Needs on the GPU machine: CUDA, torch >= 2.11, triton >= 3.6, numpy, transformers; pytest and
# hypothesis for steps 1 and 3. Steps 6-7 need tyro, msgspec and pyzmq, which that machine lacks
# and cannot download: prepare them HERE first (bash scripts/device_check_prepare.sh puts their
# wheels in .whl/ and the tiny model folder in .devcheck/), then carry ".whl" and ".devcheck" with
# the run; this script installs the wheels into /tmp/site when `import tyro` fails. No network.
# Not used by CI.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1   # real kernels; tests/conftest.py only sets it when unset
LOG_DIR="${OUT:-/tmp/device_check}"
mkdir -p "$LOG_DIR"
STEPS="${STEPS:-1 2 3 4 5 6 7}"
RESULTS="$LOG_DIR/steps.jsonl"
: > "$RESULTS"

# staleflow from this checkout without pip: a shim package of symlinks on PYTHONPATH (+ tests/ for
# the reward function of step 6 and the test helpers)
SHIM="$(mktemp -d)"
mkdir "$SHIM/staleflow"
for f in "$PWD"/src/staleflow/*; do ln -s "$f" "$SHIM/staleflow/"; done
[ -e "$SHIM/staleflow/kernels" ] || ln -s "$PWD/kernels" "$SHIM/staleflow/kernels"
export PYTHONPATH="$SHIM:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
trap 'rm -rf "$SHIM"' EXIT

if ! python -c "import tyro, msgspec, zmq" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

nvidia-smi -L || true
python -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" || exit 2

# record STEP NAME RC SECONDS LOG: the step's last JSON line (or a status line) into $RESULTS
record() {
    local step=$1 name=$2 rc=$3 secs=$4 log=$5 line
    line=$(grep '^{' "$log" 2>/dev/null | tail -1)
    python - "$step" "$name" "$rc" "$secs" "$line" >> "$RESULTS" <<'PY'
import json, sys
step, name, rc, secs, line = sys.argv[1:6]
try:
    detail = json.loads(line) if line else {}
except ValueError:
    detail = {}
status = "timeout" if rc in ("124", "137") else ("pass" if rc == "0" else ("skipped" if rc == "skip" else "fail"))
print(json.dumps({"step": int(step), "name": name, "status": status, "rc": rc, "seconds": float(secs), "detail": detail}))
PY
}

# run STEP NAME TIMEOUT COMMAND...: one step under its own timeout, logged to $LOG_DIR/NAME.log
run() {
    local step=$1 name=$2 limit=$3 t0 rc log="$LOG_DIR/$2.log"
    shift 3
    case " $STEPS " in *" $step "*) ;; *) return 0 ;; esac
    echo "== step $step: $name (timeout ${limit}s)"
    t0=$(date +%s.%N)
    timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
    rc=$?
    tail -n 5 "$log"
    record "$step" "$name" "$rc" "$(python -c "import time; print(round(time.time() - $t0, 1))")" "$log"
}

have() { python -c "import $1" 2>/dev/null; }
PYTEST="python -m pytest -q -s -p no:cacheprovider"
KERNEL_TESTS="tests/test_kernels.py tests/test_kernels_gpu.py"
have hypothesis && KERNEL_TESTS="$KERNEL_TESTS tests/test_kernels_props.py"

if have pytest; then
    run 1 kernel_tests 90 $PYTEST $KERNEL_TESTS
else
    run 1 kernel_tests 90 python tests/test_kernels_gpu.py
fi
run 1 kernel_bench 90 python scripts/bench_kernels.py --reps 2
run 2 paged_decode 80 python tests/test_kernels_paged_decode_gpu.py
if have pytest && have hypothesis && have transformers; then
    run 3 engine_gpu 70 $PYTEST tests/test_engine_gpu.py
else
    case " $STEPS " in *" 3 "*) echo '{"skipped": "needs pytest, hypothesis and transformers"}' > "$LOG_DIR/engine_gpu.log"
        record 3 engine_gpu skip 0 "$LOG_DIR/engine_gpu.log" ;; esac
fi
run 4 trainer_nccl 60 python scripts/device_check_steps.py trainer --device cuda
run 5 ps_ipc 45 python scripts/device_check_steps.py ps --device cuda

MODEL=".devcheck/tiny-llama"
RUN_DIR="$(mktemp -d)"
cat > "$SHIM/run_2proc.sh" <<STEP6
python -m torch.distributed.run --standalone --nproc_per_node=2 -m staleflow train --preset tiny --rollout.ranks 1 \
    --model.path "$MODEL" --steps 2 --log.run-dir "$RUN_DIR" --log.no-progress --log.no-tensorboard --log.no-plot \
    --reward.fn e2e_rewards:text_length
rc=\$?
python - "$RUN_DIR" "\$rc" <<'PY'
import glob, json, sys
rows = [json.loads(l) for f in glob.glob(f"{sys.argv[1]}/*/metrics.jsonl") for l in open(f) if l.strip()]
print(json.dumps({"rc": int(sys.argv[2]), "steps": len(rows), "ok": sys.argv[2] == "0" and len(rows) >= 2,
                  "step_time_s": [round(r.get("step_time_s", 0), 3) for r in rows]}))
PY
exit \$rc
STEP6
if [ -f "$MODEL/config.json" ] && have tyro && have msgspec && have zmq; then
    run 6 torchrun_2proc 110 bash "$SHIM/run_2proc.sh"
else
    case " $STEPS " in *" 6 "*) echo '{"skipped": "run scripts/device_check_prepare.sh here and carry .whl and .devcheck"}' \
        > "$LOG_DIR/torchrun_2proc.log"; record 6 torchrun_2proc skip 0 "$LOG_DIR/torchrun_2proc.log" ;; esac
fi
if have tyro; then
    run 7 plan_7b 20 python -m staleflow plan --preset gpu-7b --gpu-memory-gib 80
fi
rm -rf "$RUN_DIR"

# one table on stdout, one JSON file under $OUT
python - "$RESULTS" "$LOG_DIR/device_check.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"steps": rows, "ok": all(r["status"] in ("pass", "skipped") for r in rows)}, open(sys.argv[2], "w"), indent=1)
print(f"\n{'step':>4}  {'name':<16} {'status':<8} {'seconds':>8}  key numbers")
for r in rows:
    d = r["detail"]
    keys = [k for k in ("loss_rel_diff", "kernel_logp_max_abs_diff", "kernel_grad_rel_diff", "peak_gib",
                        "pulls", "reader_context_gib_each", "owner_context_gib", "max_gpu_gib", "fits", "steps",
                        "error", "skipped") if k in d]
    text = ", ".join(f"{k}={json.dumps(d[k])[:60]}" for k in keys)
    print(f"{r['step']:>4}  {r['name']:<16} {r['status']:<8} {r['seconds']:>8.1f}  {text}")
print(f"wrote {sys.argv[2]}")
PY
python -c "import json, sys; sys.exit(0 if json.load(open('$LOG_DIR/device_check.json'))['ok'] else 1)"
