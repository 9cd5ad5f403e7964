#!/usr/bin/env bash
# One-shot GPU check for a session with an NVIDIA GPU (written for one H200 and ~15 minutes of
# device time): GPU and software versions, gradient fidelity at realistic sizes, GS's backward
# overhead on ResNet-50, full-step times of GS vs GradScaler on SegNet-basic and SSD512, and what an
# update iteration costs against a plain backward on the torchvision and RNN zoo (issue 19, item 5).
#
#   bench/gpu_check.sh        # from the repository root, with `python` the project's env
#
# Every stage has a timeout so that one hang cannot eat the budget; the timeouts add up to
# under 10 minutes. A failing stage does not stop the later ones: failures are listed at the end
# and make the exit status nonzero. Everything is also written to bench/gpu_check.log.
set -euo pipefail

cd "$(dirname "$0")/.."  # the repository root, wherever the script is called from
LOG=bench/gpu_check.log
export PYTHONUNBUFFERED=1  # progress reaches the log as it happens, not when a stage ends
FAILED=()

# stage NAME SECONDS COMMAND...: run COMMAND under a timeout, record a failure instead of exiting.
stage() {
    local name=$1 seconds=$2
    shift 2
    echo
    echo "=== ${name} (timeout ${seconds} s), $(date -u '+%Y-%m-%d %H:%M:%S UTC') ==="
    echo "+ $*"
    local start=${SECONDS} rc=0
    timeout --kill-after=5 "${seconds}" "$@" || rc=$?
    echo "=== ${name}: exit ${rc} after $((SECONDS - start)) s ==="
    if ((rc == 124 || rc == 137)); then
        FAILED+=("${name} (timed out after ${seconds} s)")
    elif ((rc != 0)); then
        FAILED+=("${name} (exit ${rc})")
    fi
}

versions() {
    python - <<'PY'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
PY
    python -m pip show torch | grep -E '^(Name|Version|Location):'
}
export -f versions  # timeout runs commands, not shell functions: it gets `bash -c versions`

main() {
    echo "gpu_check on $(hostname), $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    stage "nvidia-smi" 15 nvidia-smi
    stage "versions" 40 bash -c versions
    stage "fidelity" 210 python bench/fidelity.py --device cuda --size realistic
    stage "overhead" 120 python bench/overhead.py --device cuda --autocast --arch resnet50 --batch-size 256 --image-size 224 --rounds 10
    stage "step_time" 90 python bench/step_time.py --device cuda --size realistic
    stage "update_cost" 120 python bench/update_cost.py --device cuda --families torchvision rnn --image-size 224 --batch-scale 16 --rounds 3
    echo
    echo "=== done, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), ${SECONDS} s ==="
    if ((${#FAILED[@]})); then
        printf 'FAILED: %s\n' "${FAILED[@]}"
        return 1
    fi
    echo "all stages passed"
}

main 2>&1 | tee "${LOG}"
