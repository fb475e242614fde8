#!/usr/bin/env bash
# compute-sanitizer TOOL over sanitize_tpp.py (our tpp_ kernels only), for run_on_device.sh.
# Exit: 0 clean; 99 the tool found an error; 75 the tool refused this machine (seen on gVisor
# H200s: "Device not supported", then error 999), which is no verdict rather than a failure;
# anything else: the run itself failed.
# Usage: sanitize.sh SANITIZER TOOL PYTHON
set -uo pipefail
san=$1 tool=$2 py=$3
log=$(mktemp)
trap 'rm -f "$log"' EXIT
PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$san" --tool "$tool" --kernel-name kns=tpp_ --error-exitcode 99 \
  --print-limit 20 "$py" "$(dirname "$0")/sanitize_tpp.py" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if (( rc != 0 && rc != 99 )) && grep -q -i "device not supported" "$log"; then
  echo "compute-sanitizer refused this machine: no verdict"
  exit 75
fi
exit "$rc"
