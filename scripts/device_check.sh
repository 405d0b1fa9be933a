#!/usr/bin/env bash
# The prepared GPU check of StaleFlow: ONE call of the run tool (timeout_s 600, kind nvidia-h100-x1) runs
# both parts, every step under a limit that leaves room for the compiles it does from an empty Triton
# cache; the limits of the nine steps sum to at most 570 s (the dry run prints the plan and refuses more).
# Each part writes its own files as it goes, so a stop at the call's timeout still returns every finished
# step (docs/device-check.md):
#
#   part correctness (limits 345 s)
#     1 env            driver, CUDA, NCCL, torch, Triton, /dev/shm, torch.mm out_dtype, the kernel (uname -r)
#                      and whether it is a sandbox (gVisor) that may refuse CUDA IPC
#     2 ps_ipc         bf16 Parameter Server slots written by two piece owners, CUDA IPC pulls by two
#                      other processes, bytes checked       (skipped under gVisor: CUDA IPC; needs msgspec)
#     3 torchrun_2proc torchrun, 2 processes on the one GPU (1 trainer + 1 rollout), tiny model, 2 steps,
#                      the final checkpoint (no HF export)   (skipped under gVisor; needs tyro, msgspec, pyzmq)
#     4 engine_gpu     the built-in engine on CUDA: greedy == transformers, fp32 logits, paged == gather
#     5 kernel_tests   the log-prob and paged-decode kernels' GPU tests at real shapes
#     6 decode_graphs  tests/test_decode_device.py: CUDA-graph replay == eager, through a pull; syncs per step
#   part benchmark (limits 225 s)
#     7 kernel_bench   the log-prob kernel at the 7B shape (16k x 3584 x 152064) vs the verl-style chunked path
#     8 engine_7b      the built-in engine at Qwen2.5-7B shape, random bf16 weights, 64 x (1024 + 128):
#                      triton, triton + CUDA graphs, gather (scripts/bench_engine_shape.py); then a cost-model
#                      sweep on triton (7 cells, n 1-256, KV up to 99k tokens, ~10 s) into $OUT/cost_samples.jsonl,
#                      which scripts/fit_cost_model.py --samples ... --profile h100|h200 refits
#     9 trainer_7b     2 decoder layers at 7B width, 16k-token micro-batches (scripts/bench_trainer_shape.py;
#                      needs msgspec)
#
#   bash scripts/device_check.sh                      # on the GPU machine: both parts, one call of the run tool
#   bash scripts/device_check.sh correctness          # one part only (benchmark: the other)
#   bash scripts/device_check.sh --dry-run            # any machine: the plan (every step, its limit, the sum)
#                                                     # and every configuration validated (no GPU; CI runs it)
#   STEPS="1 6" bash scripts/device_check.sh          # a subset
#
# Each step runs under scripts/device_check_run.py: its own limit, and at its end (or limit) every process
# it started is killed (torchrun's workers too, which sit in sessions of their own), then the GPU is
# checked free before the next step. Output: a table on stdout and two files under $OUT per part:
# device_check_<part>.json (environment, every step's status, seconds, limit, last JSON line, what was
# skipped and why) and device_check_<part>_logs.tar.gz. The interpreter: $PYTHON, else the active venv's,
# else this checkout's .venv, else python3 (never a bare `python`, which the device image may lack).
# Steps 2, 3 and 9 need msgspec (3 also tyro and pyzmq), which the GPU image lacks: run
# scripts/device_check_prepare.sh here first and carry ".whl" and ".devcheck" (the wheels are installed
# into /tmp/site when needed); without them those steps are skipped, and the summary says so.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
CALL=""
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=1 ;;
        correctness | benchmark) CALL="$a" ;;
        all) CALL="" ;;
        *) echo "device_check: unknown argument '$a': none (both parts), correctness, benchmark or --dry-run" >&2; exit 2 ;;
    esac
done
# The plan: each step's limit (s). Derived in docs/device-check.md ("How the limits were set") from the
# Triton compiles each step does from an empty cache; the sum must leave the run tool's 600 s room for the
# shim, the wheels and the per-step cleanup.
declare -A LIMIT=([1]=30 [2]=30 [3]=75 [4]=50 [5]=120 [6]=40 [7]=55 [8]=100 [9]=70)
CALL_TIMEOUT_S=600
PLAN_MAX_S=570
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
mkdir "$SHIM/staleflow" "$SHIM/staleflow/kernels"
for f in "$PWD"/src/staleflow/*; do [ "$(basename "$f")" = kernels ] || ln -s "$f" "$SHIM/staleflow/"; done
# staleflow.kernels from the sources themselves (src/staleflow/kernels holds symlinks, which a copy of the
# checkout may not keep)
ln -s "$PWD/src/staleflow/kernels/__init__.py" "$SHIM/staleflow/kernels/__init__.py"
for f in "$PWD"/kernels/*.py; do ln -s "$f" "$SHIM/staleflow/kernels/"; done
export PYTHONPATH="$SHIM:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
RUN_DIR="$(mktemp -d)"
# an empty Triton cache of this call's own: every step compiles what it needs (as on a fresh machine), and
# its count of compiles is measured (the step's triton_compiles in the JSON)
export TRITON_CACHE_DIR="${STALEFLOW_DEVCHECK_TRITON_CACHE:-$(mktemp -d)}"
trap 'rm -rf "$SHIM" "$LOG_DIR" "$RUN_DIR"; [ -n "${STALEFLOW_DEVCHECK_TRITON_CACHE:-}" ] || rm -rf "$TRITON_CACHE_DIR"' EXIT

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
compiles = int(sys.argv[9]) if len(sys.argv) > 9 and sys.argv[9] else None
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
                  "limit_s": int(limit), "runner": runner, "triton_compiles": compiles, "detail": detail}))
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
    PLANNED=$((PLANNED + limit))
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
    local compiled_before
    compiled_before=$(compiles)
    res=$("$PY" scripts/device_check_run.py --limit "$limit" --log "$log" -- "$@" | tail -n 1)
    rc=$("$PY" -c "import json, sys; print(json.loads(sys.argv[1])['rc'])" "$res" 2>/dev/null || echo 1)
    case "$rc" in 0) status=pass ;; 124) status=timeout ;; *) status=fail ;; esac
    tail -n 5 "$log"
    echo "   runner: $res"
    record "$n" "$name" "$status" "$rc" "$("$PY" -c "import json, sys; print(json.loads(sys.argv[1])['seconds'])" "$res" 2>/dev/null || echo 0)" "$limit" "$log" "$res" "$(($(compiles) - compiled_before))"
}

# compiles: kernels Triton has compiled into this call's cache so far (one .cubin each; 0 on a CPU). A step's
# difference is its measured compile count, the figure its limit was derived from (docs/device-check.md).
compiles() { find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l; }

# skip N NAME LIMIT WHY: a step that cannot run here (a dry run still validates it through step)
skip() {
    case " $STEPS " in *" $1 "*) ;; *) return 0 ;; esac
    PLANNED=$((PLANNED + $3))
    echo "== step $1: $2 skipped: $4"
    "$PY" -c "import json, sys; print(json.dumps({'skipped': sys.argv[1]}))" "$4" > "$LOG_DIR/$2.log"
    record "$1" "$2" skipped 0 0 "$3" "$LOG_DIR/$2.log"
}

# summary CALL [partial]: the table, device_check_CALL.json and its logs under $OUT; exit status of the part.
# "partial" (after every step of a real run): only the JSON so far and the logs, quietly, so a call the
# run tool stops at its timeout still returns every finished step's result.
summary() {
    local call=$1 partial=${2:-}
    "$PY" - "$RESULTS" "$OUT_DIR/device_check_$call.json" "$DRY" "$call" "$partial" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
env = next((r["detail"] for r in rows if r["name"] == "env" and r["status"] == "pass"), {})
skipped = {r["name"]: r["detail"].get("skipped", "") for r in rows if r["status"] == "skipped"}
summary = {
    "call": sys.argv[4],
    "dry_run": sys.argv[3] == "1",
    "env": env,
    "limit_total_s": sum(r["limit_s"] for r in rows),
    "seconds_total": round(sum(r["seconds"] for r in rows), 1),
    "steps": rows,
    "skipped": skipped,
    "ok": all(r["status"] in ("pass", "skipped", "dry-run") for r in rows),
    "complete": not skipped and all(r["status"] in ("pass", "dry-run") for r in rows),
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
    if r["status"] in ("fail", "timeout") and r["rc"] not in ("0", 0):
        text += f", exit code {r['rc']}"
    if r.get("triton_compiles"):
        text += f", triton compiles={r['triton_compiles']}"
    left = r["runner"].get("left")
    if left:
        text += f", processes left={left}"
    if r["runner"].get("gpu_free") is False:
        text += ", GPU still busy after the step"
    print(f"{r['step']:>4}  {r['name']:<15} {r['status']:<8} {r['seconds']:>7.1f} {r['limit_s']:>5}  {text}")
for name, why in skipped.items():
    print(f"NOT COVERED: {name}: skipped: {why}")
if {"ps_ipc", "torchrun_2proc"} & set(skipped) and any("gVisor" in w or "gvisor" in w for w in skipped.values()):
    print("NOT COVERED: CUDA IPC (the Parameter Server's pulls, the 2-process run's weights): this machine is a "
          "gVisor sandbox; run the check on the nvidia-h100-x1 kind to cover it")
verdict = "ok" if summary["ok"] else "FAILED"
if summary["ok"] and skipped:
    verdict = f"ok, but {len(skipped)} step(s) skipped (above)"
print(f"part {sys.argv[4]}: {verdict}; limits {summary['limit_total_s']} s in all; wrote {sys.argv[2]}")
sys.exit(0 if summary["ok"] else 1)
PY
    local rc=$?
    tar -czf "$OUT_DIR/device_check_${call}_logs.tar.gz" -C "$LOG_DIR" .
    [ -n "$partial" ] && return 0
    : > "$RESULTS"
    return $rc
}

NEEDS_WHEELS="not in the GPU image: run scripts/device_check_prepare.sh here and carry .whl and .devcheck"

correctness() {
    [ "$DRY" = 1 ] && echo "part correctness"
    step 1 env "${LIMIT[1]}" -- "$PY" scripts/device_check_steps.py env
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
    if [ "$DRY" = 1 ] || have msgspec; then
        step 2 ps_ipc "${LIMIT[2]}" --ipc -- "$PY" scripts/device_check_steps.py ps --device cuda
    else
        skip 2 ps_ipc "${LIMIT[2]}" "needs msgspec, $NEEDS_WHEELS"
    fi
    if [ "$DRY" = 1 ] || { [ -f "$MODEL/config.json" ] && have tyro && have msgspec && have zmq; }; then
        step 3 torchrun_2proc "${LIMIT[3]}" --ipc -- bash "$SHIM/run_2proc.sh"
    else
        skip 3 torchrun_2proc "${LIMIT[3]}" "needs tyro, msgspec, pyzmq and the tiny model, $NEEDS_WHEELS"
    fi
    if [ "$DRY" = 1 ] || { have pytest && have hypothesis && have transformers; }; then
        step 4 engine_gpu "${LIMIT[4]}" -- "${PYTEST[@]}" tests/test_engine_gpu.py
        step 5 kernel_tests "${LIMIT[5]}" -- "${PYTEST[@]}" tests/test_kernels_gpu.py tests/test_kernels_paged_decode_gpu.py
        step 6 decode_graphs "${LIMIT[6]}" -- "${PYTEST[@]}" tests/test_decode_device.py
    else
        skip 4 engine_gpu "${LIMIT[4]}" "needs pytest, hypothesis and transformers"
        skip 5 kernel_tests "${LIMIT[5]}" "needs pytest, hypothesis and transformers"
        skip 6 decode_graphs "${LIMIT[6]}" "needs pytest, hypothesis and transformers"
    fi
}

benchmark() {
    [ "$DRY" = 1 ] && echo "part benchmark"
    SANDBOX="" KERNEL=""
    step 7 kernel_bench "${LIMIT[7]}" -- "$PY" scripts/bench_kernels.py --shapes 16384x3584x152064 --reps 2 \
        --skip naive,chunked-train
    step 8 engine_7b "${LIMIT[8]}" -- "$PY" scripts/bench_engine_shape.py --batch 64 --prompt 1024 --new-tokens 128 \
        --configs "$ENGINE_CONFIGS" --cost-samples "$OUT_DIR/cost_samples.jsonl"
    if [ "$DRY" = 1 ] || have msgspec; then
        step 9 trainer_7b "${LIMIT[9]}" -- "$PY" scripts/bench_trainer_shape.py --layers 2 --micro-batch-tokens 16384 --len 1024
    else
        skip 9 trainer_7b "${LIMIT[9]}" "needs msgspec, $NEEDS_WHEELS"
    fi
}

echo "device_check: interpreter $PY"
rc=0
PLANNED=0
for call in correctness benchmark; do
    [ -z "$CALL" ] || [ "$CALL" = "$call" ] || continue
    CUR_CALL=$call
    "$call"
    summary "$call" || rc=1
done
if [ "$DRY" = 1 ]; then
    echo "plan: one call of the run tool (timeout_s $CALL_TIMEOUT_S, kind nvidia-h100-x1) runs both parts; the step limits sum to $PLANNED s (at most $PLAN_MAX_S)"
    if [ "$PLANNED" -gt "$PLAN_MAX_S" ]; then
        echo "INVALID plan: the step limits sum to $PLANNED s, over $PLAN_MAX_S s: the call would run past its $CALL_TIMEOUT_S s" >&2
        INVALID=1
    fi
    if [ "$INVALID" = 0 ]; then
        echo "dry run: configurations validated: every configuration of the $VALIDATED steps resolved through the checks the CUDA run uses"
    else
        echo "dry run: configuration validation FAILED (the INVALID lines above): the device run would fail there" >&2
        rc=2
    fi
else
    echo "device_check: done (parts: ${CALL:-correctness benchmark}); the JSON and logs of each part are under $OUT_DIR"
fi
exit "$rc"
