#!/usr/bin/env bash
# One prepared GPU check of StaleFlow (issue 27), sized for ONE H200 run of at most 6 minutes: every
# step has its own `limit N s` (a timeout) and the limits add up to 360 s; the cheap integration
# steps run first, so a short budget still answers whether the system runs. Steps:
#   1 env             driver, CUDA, NCCL, torch, Triton, /dev/shm, torch.mm out_dtype support
#   2 ps_ipc          bf16 Parameter Server slots written by two piece owners, CUDA IPC pulls by two
#                     other processes (own reader indices), bytes checked, pull GB/s, context sizes
#   3 torchrun_2proc  torchrun, 2 processes on the one GPU (1 trainer + 1 rollout), tiny model, 2 steps
#   4 engine_gpu      the built-in engine on CUDA: greedy == transformers, fp32 logits, paged == gather
#   5 kernel_tests    the log-prob and paged-decode kernels' GPU tests at real shapes
#   6 kernel_bench    the log-prob kernel benchmark at the 7B shape only (16k x 3584 x 152064)
#   7 engine_7b       the built-in engine at Qwen2.5-7B shape, random bf16 weights, 64 x (1024 + 256):
#                     paged kernel vs gather, with and without CUDA graphs (when the engine has them),
#                     ms/step, tokens/s, peak memory vs the plan's rollout row (scripts/bench_engine_shape.py)
#   8 trainer_7b      2 decoder layers at 7B width, 16k-token micro-batches: tokens/s, peak memory vs
#                     the plan's trainer row (scripts/bench_trainer_shape.py)
# Output: a table on stdout and exactly two files under $OUT: device_check.json (the environment,
# every step's status, seconds, limit and last JSON line) and device_check_logs.tar.gz (one log per step).
#
#   bash scripts/device_check.sh                  # from anywhere; runs from the repo root
#   bash scripts/device_check.sh --dry-run        # print each step with its limit, run nothing (any machine)
#   STEPS="1 7 8" bash scripts/device_check.sh    # a subset
#
# Needs on the GPU machine: CUDA, torch >= 2.11, triton >= 3.6, numpy, transformers; pytest and
# hypothesis for steps 4-5. Step 3 needs tyro, msgspec and pyzmq, which that machine lacks and cannot
# download: prepare them HERE first (bash scripts/device_check_prepare.sh puts their wheels in .whl/
# and the tiny model folder in .devcheck/), then carry ".whl" and ".devcheck" with the run; this
# script installs the wheels into /tmp/site when `import tyro` fails. No network (HF_HUB_OFFLINE=1).
# Not used by CI.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
# real kernels (tests/conftest.py only sets the interpreter when unset); nothing from the network
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT_DIR="${OUT:-/tmp/device_check}"
mkdir -p "$OUT_DIR"
LOG_DIR="$(mktemp -d)"   # one log per step; tarred into $OUT_DIR at the end
STEPS="${STEPS:-1 2 3 4 5 6 7 8}"
RESULTS="$LOG_DIR/steps.jsonl"
: > "$RESULTS"

# staleflow from this checkout without pip: a shim package of symlinks on PYTHONPATH (+ tests/ for
# the reward function of step 6 and the test helpers)
SHIM="$(mktemp -d)"
mkdir "$SHIM/staleflow"
for f in "$PWD"/src/staleflow/*; do ln -s "$f" "$SHIM/staleflow/"; done
[ -e "$SHIM/staleflow/kernels" ] || ln -s "$PWD/kernels" "$SHIM/staleflow/kernels"
export PYTHONPATH="$SHIM:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
trap 'rm -rf "$SHIM" "$LOG_DIR"' EXIT

if [ "$DRY" = 0 ] && ! python -c "import tyro, msgspec, zmq" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# record STEP NAME RC SECONDS LIMIT LOG: the step's last JSON line (or a status line) into $RESULTS
record() {
    local step=$1 name=$2 rc=$3 secs=$4 limit=$5 log=$6 line
    line=$(grep '^{' "$log" 2>/dev/null | tail -1)
    python - "$step" "$name" "$rc" "$secs" "$limit" "$line" >> "$RESULTS" <<'PY'
import json, sys
step, name, rc, secs, limit, line = sys.argv[1:7]
try:
    detail = json.loads(line) if line else {}
except ValueError:
    detail = {}
status = {"124": "timeout", "137": "timeout", "0": "pass", "skip": "skipped", "dry": "dry-run"}.get(rc, "fail")
print(json.dumps({"step": int(step), "name": name, "status": status, "rc": rc, "seconds": float(secs),
                  "limit_s": int(limit), "detail": detail}))
PY
}

# run STEP NAME LIMIT COMMAND...: one step under its own limit (timeout), logged to $LOG_DIR/NAME.log
run() {
    local step=$1 name=$2 limit=$3 t0 rc log="$LOG_DIR/$2.log"
    shift 3
    case " $STEPS " in *" $step "*) ;; *) return 0 ;; esac
    if [ "$DRY" = 1 ]; then
        echo "step $step $name: limit $limit s: $*"
        echo "$*" > "$log"
        record "$step" "$name" dry 0 "$limit" "$log"
        return 0
    fi
    echo "== step $step: $name (limit $limit s)"
    t0=$(date +%s.%N)
    timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
    rc=$?
    tail -n 5 "$log"
    record "$step" "$name" "$rc" "$(python -c "import time; print(round(time.time() - $t0, 1))")" "$limit" "$log"
}

# skip STEP NAME LIMIT WHY: a step that cannot run here, recorded as skipped (a dry run lists it anyway)
skip() {
    case " $STEPS " in *" $1 "*) ;; *) return 0 ;; esac
    if [ "$DRY" = 1 ]; then
        echo "step $1 $2: limit $3 s: skipped here ($4)"
        echo "$4" > "$LOG_DIR/$2.log"
        record "$1" "$2" dry 0 "$3" "$LOG_DIR/$2.log"
        return 0
    fi
    python -c "import json, sys; print(json.dumps({'skipped': sys.argv[1]}))" "$4" > "$LOG_DIR/$2.log"
    record "$1" "$2" skip 0 "$3" "$LOG_DIR/$2.log"
}

have() { python -c "import $1" 2>/dev/null; }
PYTEST="python -m pytest -q -s -p no:cacheprovider"

run 1 env 10 python scripts/device_check_steps.py env
run 2 ps_ipc 30 python scripts/device_check_steps.py ps --device cuda

MODEL=".devcheck/tiny-llama"
RUN_DIR="$(mktemp -d)"
cat > "$SHIM/run_2proc.sh" <<STEP3
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
STEP3
if [ "$DRY" = 1 ] || { [ -f "$MODEL/config.json" ] && have tyro && have msgspec && have zmq; }; then
    run 3 torchrun_2proc 60 bash "$SHIM/run_2proc.sh"
else
    skip 3 torchrun_2proc 60 "run scripts/device_check_prepare.sh here and carry .whl and .devcheck"
fi
if [ "$DRY" = 1 ] || { have pytest && have hypothesis && have transformers; }; then
    run 4 engine_gpu 45 $PYTEST tests/test_engine_gpu.py
    run 5 kernel_tests 45 $PYTEST tests/test_kernels_gpu.py tests/test_kernels_paged_decode_gpu.py
else
    skip 4 engine_gpu 45 "needs pytest, hypothesis and transformers"
    skip 5 kernel_tests 45 "needs pytest, hypothesis and transformers"
fi
run 6 kernel_bench 30 python scripts/bench_kernels.py --shapes 16384x3584x152064 --reps 2 --skip naive
run 7 engine_7b 80 python scripts/bench_engine_shape.py --batch 64 --prompt 1024 --new-tokens 256
run 8 trainer_7b 60 python scripts/bench_trainer_shape.py --layers 2 --micro-batch-tokens 16384 --len 1024
rm -rf "$RUN_DIR"

# one table on stdout; two files under $OUT: the JSON summary and a tarball of the logs
python - "$RESULTS" "$OUT_DIR/device_check.json" "$DRY" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
env = next((r["detail"] for r in rows if r["name"] == "env" and r["status"] == "pass"), {})
summary = {
    "dry_run": sys.argv[3] == "1",
    "env": env,
    "limit_total_s": sum(r["limit_s"] for r in rows),
    "seconds_total": round(sum(r["seconds"] for r in rows), 1),
    "steps": rows,
    "ok": all(r["status"] in ("pass", "skipped", "dry-run") for r in rows),
}
json.dump(summary, open(sys.argv[2], "w"), indent=1)
print(f"\n{'step':>4}  {'name':<15} {'status':<8} {'seconds':>7} {'limit':>5}  key numbers")
for r in rows:
    d = r["detail"]
    keys = [k for k in ("torch", "cuda", "mm_out_dtype", "pulls", "reader_context_gib_each", "steps", "peak_gib",
                        "plan_gib", "peak_vs_plan", "tokens_per_s", "cuda_graphs", "error", "skipped") if k in d]
    text = ", ".join(f"{k}={json.dumps(d[k])[:60]}" for k in keys)
    print(f"{r['step']:>4}  {r['name']:<15} {r['status']:<8} {r['seconds']:>7.1f} {r['limit_s']:>5}  {text}")
print(f"limits {summary['limit_total_s']} s in all; wrote {sys.argv[2]}")
PY
tar -czf "$OUT_DIR/device_check_logs.tar.gz" -C "$LOG_DIR" .
python -c "import json, sys; sys.exit(0 if json.load(open('$OUT_DIR/device_check.json'))['ok'] else 1)"
