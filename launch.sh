#!/usr/bin/env bash
# StaleFlow one-line start: sets up .venv on first use, then runs training under torchrun.
#   ./launch.sh                          the embedded default (SmolLM2-135M, arithmetic, CPU, 3 processes)
#   ./launch.sh --model.path /models/Qwen2.5-7B --rollout.ranks 4 ...   (GPU node: one process per GPU)
# NPROC=N overrides the process count.
set -euo pipefail
cd "$(dirname "$0")"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || bash scripts/setup_env.sh
  . .venv/bin/activate
fi
if [ -z "${NPROC:-}" ]; then
  gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$gpus" -gt 0 ]; then NPROC=$gpus; else NPROC=3; fi
fi
exec torchrun --standalone --nproc_per_node="$NPROC" -m staleflow train "$@"
