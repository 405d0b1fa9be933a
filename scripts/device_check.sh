#!/usr/bin/env bash
# The prepared GPU check of StaleFlow (issue 36): two calls, each at most 300 s of step limits, each
# returning its own files, so a benchmark failure costs no correctness result (docs/device-check.md):
#
#   call correctness (limits 300 s)
#     1 env            driver, CUDA, NCCL, torch, Triton, /dev/shm, torch.mm out_dtype, the kernel (uname -r)
#                      and whether it is a sandbox (gVisor) that may refuse CUDA IPC
#     2 ps_ipc         bf16 Parameter Server slots written by two piece owners, CUDA IPC pulls by two
#                      other processes, bytes checked                      (skipped under gVisor: CUDA IPC)
#     3 torchrun_2proc torchrun, 2 processes on the one GPU (1 trainer + 1 rollout), tiny model, 2 steps,
#                      the final checkpoint (no HF export)                 (skipped under gVisor: CUDA IPC)
#     4 engine_gpu     the built-in engine on CUDA: greedy == transformers, fp32 logits, paged == gather
#     5 kernel_tests   the log-prob and paged-decode kernels' GPU tests at real shapes
#     6 decode_graphs  tests/test_decode_device.py: CUDA-graph replay == eager, through a pull; syncs per step
#   call benchmark (limits 290 s)
#     7 kernel_bench   the log-prob kernel at the 7B shape (16k x 3584 x 152064) vs the verl-style chunked path
#     8 engine_7b      the built-in engine at Qwen2.5-7B shape, random bf16 weights, 64 x (1024 + 128):
#                      triton, triton + CUDA graphs, gather (scripts/bench_engine_shape.py); then a cost-model
#                      sweep on triton (7 cells, n 1-256, KV up to 99k tokens, ~10 s) into $OUT/cost_samples.jsonl,
#                      which scripts/fit_cost_model.py --samples ... --profile h100|h200 refits
#     9 trainer_7b     2 decoder layers at 7B width, 16k-token micro-batches (scripts/bench_trainer_shape.py)
#
#   bash scripts/device_check.sh correctness          # on the GPU machine, one call of the run tool
#   bash scripts/device_check.sh benchmark            # the second call
#   bash scripts/device_check.sh --dry-run            # any machine: both calls' steps, limits, and every
#                                                     # configuration validated (no GPU needed; CI runs it)
#   STEPS="1 6" bash scripts/device_check.sh correctness   # a subset
#
# Each step runs under scripts/device_check_run.py: its own limit, and at its end (or limit) every process
# it started is killed (torchrun's workers too, which sit in sessions of their own), then the GPU is
# checked free before the next step. Output: a table on stdout and two files under $OUT per call:
# device_check_<call>.json (environment, every step's status, seconds, limit, last JSON line) and
# device_check_<call>_logs.tar.gz. The interpreter: $PYTHON, else the active venv's, else this checkout's
# .venv, else python3 (never a bare `python`, which the device image may lack).
# Step 3 needs tyro, msgspec and pyzmq, which the GPU machine lacks: run scripts/device_check_prepare.sh
# here first and carry ".whl" and ".devcheck" (the wheels are installed into /tmp/site when needed).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
CALL=""
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=1 ;;
        correctness | benchmark) CALL="$a" ;;
        *) echo "device_check: unknown argument '$a': use correctness, benchmark or --dry-run" >&2; exit 2 ;;
    esac
done
if [ "$DRY" = 0 ] && [ -z "$CALL" ]; then
    echo "device_check: name the call: bash scripts/device_check.sh correctness (then benchmark), or --dry-run" >&2
    exit 2
fi
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY="$VIRTUAL_ENV/bin/python"
elif [ -x .venv/bin/python ]; then PY="$PWD/.venv/bin/python"
elif command -v python3 >/dev/null 2>&1; then PY="$(command -v python3)"
else echo "device_check: no python3 on PATH: set PYTHON=/path/to/python" >&2; exit 2
fi
# real kernels (tests/conftest.py only sets the interpreter when unset); nothing from the network
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT_DIR="${OUT:-/tmp/device_check}"
mkdir -p "$OUT_DIR"
LOG_DIR="$(mktemp -d)"
STEPS="${STEPS:-1 2 3 4 5 6 7 8 9}"
# the engine configurations of step 8 (ENGINE_CONFIGS overrides them; the dry run validates whatever it is)
ENGINE_CONFIGS="${ENGINE_CONFIGS:-triton,triton+graphs,gather}"

# staleflow from this checkout without pip: a shim package of symlinks on PYTHONPATH (+ tests/ for
# the reward function of step 3 and the test helpers)
SHIM="$(mktemp -d)"
mkdir "$SHIM/staleflow"
for f in "$PWD"/src/staleflow/*; do ln -s "$f" "$SHIM/staleflow/"; done
[ -e "$SHIM/staleflow/kernels" ] || ln -s "$PWD/kernels" "$SHIM/staleflow/kernels"
export PYTHONPATH="$SHIM:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
RUN_DIR="$(mktemp -d)"
trap 'rm -rf "$SHIM" "$LOG_DIR" "$RUN_DIR"' EXIT

if [ "$DRY" = 0 ] && ! "$PY" -c "import tyro, msgspec, zmq" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
have() { "$PY" -c "import $1" 2>/dev/null; }
PYTEST=("$PY" -m pytest -q -s -p no:cacheprovider)
MODEL=".devcheck/tiny-llama"
TRAIN_FLAGS=(--preset tiny --rollout.ranks 1 --model.path "$MODEL" --steps 2 --log.run-dir "$RUN_DIR"
    --log.no-progress --log.no-tensorboard --log.no-plot --checkpoint.no-export-hf --reward.fn e2e_rewards:text_length)
cat > "$SHIM/run_2proc.sh" <<STEP3
"$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m staleflow train ${TRAIN_FLAGS[@]@Q}
rc=\$?
"$PY" - "$RUN_DIR" "\$rc" <<'PY'
import glob, json, sys
rows = [json.loads(l) for f in glob.glob(f"{sys.argv[1]}/*/metrics.jsonl") for l in open(f) if l.strip()]
print(json.dumps({"rc": int(sys.argv[2]), "steps": len(rows), "ok": sys.argv[2] == "0" and len(rows) >= 2,
                  "step_time_s": [round(r.get("step_time_s", 0), 3) for r in rows]}))
PY
exit \$rc
STEP3

RESULTS="$LOG_DIR/steps.jsonl"
INVALID=0
VALIDATED=0
: > "$RESULTS"

# record STEP NAME STATUS RC SECONDS LIMIT LOG [RUNNER_JSON]: the step's last JSON line into $RESULTS
record() {
    "$PY" - "$@" >> "$RESULTS" <<'PY'
import json, sys
step, name, status, rc, secs, limit, log = sys.argv[1:8]
runner = json.loads(sys.argv[8]) if len(sys.argv) > 8 and sys.argv[8] else {}
line = ""
try:
    line = [l for l in open(log, errors="replace") if l.startswith("{")][-1]
except (OSError, IndexError):
    pass
try:
    detail = json.loads(line) if line else {}
except ValueError:
    detail = {}
print(json.dumps({"step": int(step), "name": name, "status": status, "rc": rc, "seconds": float(secs),
                  "limit_s": int(limit), "runner": runner, "detail": detail}))
PY
    if [ "$DRY" = 0 ] && [ -n "${CUR_CALL:-}" ]; then summary "$CUR_CALL" partial; fi
}

# step N NAME LIMIT [--ipc] -- CMD...: validate (dry run) or run one step under its limit
step() {
    local n=$1 name=$2 limit=$3 ipc=0 log="$LOG_DIR/$2.log" res rc status
    shift 3
    [ "$1" = "--ipc" ] && { ipc=1; shift; }
    [ "$1" = "--" ] && shift
    case " $STEPS " in *" $n "*) ;; *) return 0 ;; esac
    if [ "$DRY" = 1 ]; then
        echo "step $n $name: limit $limit s: $*"
        if [ "$name" = torchrun_2proc ]; then  # the flags through the check launch.sh runs
            local flags=() f
            for f in "${TRAIN_FLAGS[@]}"; do  # without the prepared folder: the alias it is copied from
                if [ "$f" = "$MODEL" ] && [ ! -f "$MODEL/config.json" ]; then flags+=(tiny-llama); else flags+=("$f"); fi
            done
            if STALEFLOW_NPROC=2 "$PY" -m staleflow check "${flags[@]}" > "$log" 2>&1; then
                res="validated $name: staleflow check accepts the run's flags (2 processes)"
            else
                res="INVALID $name: $(tail -n 1 "$log")"
            fi
        else
            res=$("$PY" scripts/device_check_validate.py "$name" -- "$@" 2>&1 | tail -n 1)
        fi
        echo "  $res"
        echo "$res" >> "$log"
        case "$res" in validated*) VALIDATED=$((VALIDATED + 1)); status=dry-run ;; *) INVALID=1; status=invalid ;; esac
        record "$n" "$name" "$status" 0 0 "$limit" "$log"
        return 0
    fi
    if [ "$ipc" = 1 ] && [ -n "$SANDBOX" ]; then
        echo "== step $n: $name skipped: CUDA IPC may be refused under $SANDBOX (kernel $KERNEL)"
        "$PY" -c "import json, sys; print(json.dumps({'skipped': sys.argv[1]}))" \
            "CUDA IPC may be refused under $SANDBOX (kernel $KERNEL)" > "$log"
        record "$n" "$name" skipped 0 0 "$limit" "$log"
        return 0
    fi
    echo "== step $n: $name (limit $limit s)"
    res=$("$PY" scripts/device_check_run.py --limit "$limit" --log "$log" -- "$@" | tail -n 1)
    rc=$("$PY" -c "import json, sys; print(json.loads(sys.argv[1])['rc'])" "$res" 2>/dev/null || echo 1)
    case "$rc" in 0) status=pass ;; 124) status=timeout ;; *) status=fail ;; esac
    tail -n 5 "$log"
    echo "   runner: $res"
    record "$n" "$name" "$status" "$rc" "$("$PY" -c "import json, sys; print(json.loads(sys.argv[1])['seconds'])" "$res" 2>/dev/null || echo 0)" "$limit" "$log" "$res"
}

# skip N NAME LIMIT WHY: a step that cannot run here (a dry run still validates it through step)
skip() {
    case " $STEPS " in *" $1 "*) ;; *) return 0 ;; esac
    "$PY" -c "import json, sys; print(json.dumps({'skipped': sys.argv[1]}))" "$4" > "$LOG_DIR/$2.log"
    record "$1" "$2" skipped 0 0 "$3" "$LOG_DIR/$2.log"
}

# summary CALL [partial]: the table, device_check_CALL.json and its logs under $OUT; exit status of the call.
# "partial" (after every step of a real run): only the JSON so far and the logs, quietly, so a call the
# run tool stops at its timeout still returns every finished step's result.
summary() {
    local call=$1 partial=${2:-}
    "$PY" - "$RESULTS" "$OUT_DIR/device_check_$call.json" "$DRY" "$call" "$partial" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
env = next((r["detail"] for r in rows if r["name"] == "env" and r["status"] == "pass"), {})
summary = {
    "call": sys.argv[4],
    "dry_run": sys.argv[3] == "1",
    "env": env,
    "limit_total_s": sum(r["limit_s"] for r in rows),
    "seconds_total": round(sum(r["seconds"] for r in rows), 1),
    "steps": rows,
    "ok": all(r["status"] in ("pass", "skipped", "dry-run") for r in rows),
}
if sys.argv[5]:
    summary["partial"] = True
json.dump(summary, open(sys.argv[2], "w"), indent=1)
if sys.argv[5]:
    sys.exit(0)
print(f"\n{'step':>4}  {'name':<15} {'status':<8} {'seconds':>7} {'limit':>5}  key numbers")
for r in rows:
    d = r["detail"]
    keys = [k for k in ("torch", "cuda", "kernel", "sandbox", "mm_out_dtype", "pulls", "steps", "peak_gib",
                        "plan_gib", "peak_vs_plan", "tokens_per_s", "cost_samples", "error", "skipped") if k in d]
    text = ", ".join(f"{k}={json.dumps(d[k])[:60]}" for k in keys)
    left = r["runner"].get("left")
    if left:
        text += f", processes left={left}"
    if r["runner"].get("gpu_free") is False:
        text += ", GPU still busy after the step"
    print(f"{r['step']:>4}  {r['name']:<15} {r['status']:<8} {r['seconds']:>7.1f} {r['limit_s']:>5}  {text}")
print(f"call {sys.argv[4]}: limits {summary['limit_total_s']} s in all; wrote {sys.argv[2]}")
sys.exit(0 if summary["ok"] else 1)
PY
    local rc=$?
    tar -czf "$OUT_DIR/device_check_${call}_logs.tar.gz" -C "$LOG_DIR" .
    [ -n "$partial" ] && return 0
    : > "$RESULTS"
    return $rc
}

correctness() {
    [ "$DRY" = 1 ] && echo "call correctness"
    step 1 env 40 -- "$PY" scripts/device_check_steps.py env
    SANDBOX="" KERNEL=""
    if [ "$DRY" = 0 ] && [ -f "$LOG_DIR/env.log" ]; then
        # '|' between the two (a whitespace IFS would drop an empty sandbox and read the kernel as one)
        IFS='|' read -r SANDBOX KERNEL < <("$PY" - "$LOG_DIR/env.log" <<'PY'
import json, sys
d = {}
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("{"):
        try:
            d = json.loads(line)
        except ValueError:
            pass
print(f"{d.get('sandbox') or ''}|{d.get('kernel') or '?'}")
PY
)
        [ -n "${STALEFLOW_DEVCHECK_IPC:-}" ] && SANDBOX=""  # forced: try CUDA IPC anyway
    fi
    step 2 ps_ipc 40 --ipc -- "$PY" scripts/device_check_steps.py ps --device cuda
    if [ "$DRY" = 1 ] || { [ -f "$MODEL/config.json" ] && have tyro && have msgspec && have zmq; }; then
        step 3 torchrun_2proc 75 --ipc -- bash "$SHIM/run_2proc.sh"
    else
        skip 3 torchrun_2proc 75 "run scripts/device_check_prepare.sh here and carry .whl and .devcheck"
    fi
    if [ "$DRY" = 1 ] || { have pytest && have hypothesis && have transformers; }; then
        step 4 engine_gpu 35 -- "${PYTEST[@]}" tests/test_engine_gpu.py
        step 5 kernel_tests 70 -- "${PYTEST[@]}" tests/test_kernels_gpu.py tests/test_kernels_paged_decode_gpu.py
        step 6 decode_graphs 40 -- "${PYTEST[@]}" tests/test_decode_device.py
    else
        for s in "4 engine_gpu 35" "5 kernel_tests 70" "6 decode_graphs 40"; do
            # shellcheck disable=SC2086
            skip $s "needs pytest, hypothesis and transformers"
        done
    fi
}

benchmark() {
    [ "$DRY" = 1 ] && echo "call benchmark"
    SANDBOX="" KERNEL=""
    step 7 kernel_bench 70 -- "$PY" scripts/bench_kernels.py --shapes 16384x3584x152064 --reps 2 \
        --skip naive,chunked-train
    step 8 engine_7b 130 -- "$PY" scripts/bench_engine_shape.py --batch 64 --prompt 1024 --new-tokens 128 \
        --configs "$ENGINE_CONFIGS" --cost-samples "$OUT_DIR/cost_samples.jsonl"
    step 9 trainer_7b 90 -- "$PY" scripts/bench_trainer_shape.py --layers 2 --micro-batch-tokens 16384 --len 1024
}

echo "device_check: interpreter $PY"
rc=0
for call in correctness benchmark; do
    [ -z "$CALL" ] || [ "$CALL" = "$call" ] || continue
    CUR_CALL=$call
    "$call"
    summary "$call" || rc=1
done
if [ "$DRY" = 1 ]; then
    if [ "$INVALID" = 0 ]; then
        echo "dry run: configurations validated: every configuration of the $VALIDATED steps resolved through the checks the CUDA run uses"
    else
        echo "dry run: configuration validation FAILED (the INVALID lines above): the device run would fail there" >&2
        rc=2
    fi
fi
exit "$rc"
