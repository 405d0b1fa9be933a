#!/usr/bin/env bash
# StaleFlow one-line start: sets up .venv on first use, checks the flags, then runs training
# under torchrun with automatic recovery:
#   ./launch.sh                          the embedded default (SmolLM2-135M, arithmetic, CPU, 3 processes)
#   ./launch.sh --model.path /models/Qwen2.5-7B --rollout.ranks 4 ...   (GPU node: one process per GPU)
# NPROC=N overrides the process count; STALEFLOW_MAX_RESTARTS=K (default 3) is how many times a
# crashed run is restarted, each restart resuming from the newest intact checkpoint by itself.
# The rendezvous listens on 127.0.0.1 only (staleflow.launch.torchrun). Exit status: the run's,
# 130 after Ctrl-C and 143 after SIGTERM (a checkpoint is saved on the way out when possible).
#   ./launch.sh --help                   this text and every flag of the run; starts nothing
set -euo pipefail
cd "$(dirname "$0")"
# Every Python below starts without the working directory in front of sys.path (Python >= 3.11's -P),
# torchrun's workers included: a folder here (kernels/) must never shadow an installed package
# (Hugging Face's kernels, which transformers imports), nor a run folder's file be imported. A module of
# your own is named on purpose: PYTHONPATH=$PWD ./launch.sh --train.loss examples.cispo:cispo_loss
# (launch/import_path.py).
export PYTHONSAFEPATH=1
for a in "$@"; do
  case "$a" in
    -h | --help)
      sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
      echo
      if [ -z "${VIRTUAL_ENV:-}" ] && [ ! -x .venv/bin/python ]; then
        echo "The run's flags: create .venv first (bash scripts/setup_env.sh), then ./launch.sh --help lists them."
        exit 0
      fi
      py=python; [ -z "${VIRTUAL_ENV:-}" ] && py=.venv/bin/python
      exec "$py" -m staleflow train --help ;;
  esac
done
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || bash scripts/setup_env.sh
  . .venv/bin/activate
fi
# A CPU-only torch on a GPU node (the quick start's .venv): one line naming `bash scripts/setup_env.sh --cuda`.
python -m staleflow.launch.environment --gpu-torch || exit $?
if [ -z "${NPROC:-}" ]; then
  gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$gpus" -gt 0 ]; then NPROC=$gpus; else NPROC=3; fi
fi
# One line and exit 2 for a bad flag, model, reward or data path: before any process starts.
STALEFLOW_NPROC="$NPROC" python -m staleflow check "$@" || exit $?
port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
run_id="staleflow$$x$RANDOM"
python -m staleflow.launch.torchrun --nnodes 1 --nproc_per_node "$NPROC" --rdzv-backend c10d \
  --rdzv-endpoint "127.0.0.1:$port" --local-addr 127.0.0.1 --rdzv-id "$run_id" \
  --max-restarts "${STALEFLOW_MAX_RESTARTS:-3}" -m staleflow train "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid" || true; python -m staleflow.runfolder.elastic "$run_id" || true; exit 143' TERM
trap 'kill -INT "$pid" 2>/dev/null; wait "$pid" || true; python -m staleflow.runfolder.elastic "$run_id" || true; exit 130' INT
code=0
wait "$pid" || code=$?
# A run that stopped on bad input exits its ranks with 0 (no restart can help); it says so here.
python -m staleflow.runfolder.elastic "$run_id" || exit $?
exit "$code"
