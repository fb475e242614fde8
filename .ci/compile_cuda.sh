#!/usr/bin/env bash
# Compile-checks every csrc/cuda/*.cu (and the test-only csrc/ptx_probe/*.cu) with this machine's
# nvcc for sm_80 and sm_90a (no GPU and no CUDA torch needed: torch's headers come from whatever
# torch is installed; a CPU wheel lacks c10/cuda/impl/cuda_cmake_macros.h, so a stub stands in).
# Exits non-zero on any error.
# Usage: .ci/compile_cuda.sh [python]   (default: python3; jobs: $JOBS or nproc)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
if ! command -v nvcc >/dev/null 2>&1; then
  echo "compile_cuda: nvcc not found, skipping the CUDA compile check"
  exit 0
fi
start=$(date +%s)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
inc=$("$PY" -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))") || {
  echo "compile_cuda: cannot import torch with $PY"; exit 1; }
torch_inc=$("$PY" -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")
if [ ! -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  mkdir -p "$tmp/stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
  inc="$inc -I$tmp/stub"
fi
pyinc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
# The -D__CUDA_NO_* defines and C++20 are what torch.utils.cpp_extension passes to nvcc (2.13+).
flags=(-std=c++20 -O3 --expt-relaxed-constexpr -DTORCH_EXTENSION_NAME=_C -Icsrc -I"$pyinc"
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       -Xptxas -warn-spills -diag-suppress 3306)
sm90=(-gencode arch=compute_90a,code=sm_90a)
# CUBIN=out.cubin CUBIN_SRC=csrc/cuda/x.cu: that one file for sm_90a only, to a cubin (its SASS
# read by tests/kernels/test_cuda_codegen.py), with the same flags.
if [ -n "${CUBIN:-}" ]; then
  nvcc "${flags[@]}" "${sm90[@]}" $inc -cubin "${CUBIN_SRC:?}" -o "$CUBIN"
  exit $?
fi
flags+=(-gencode arch=compute_80,code=sm_80 "${sm90[@]}")
echo "compile_cuda: $(nvcc --version | tail -1)"
jobs=${JOBS:-$(nproc)}
pids=()
for f in csrc/cuda/*.cu csrc/ptx_probe/*.cu; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 0.5; done
  name=$(basename "$f" .cu)
  ( t0=$(date +%s)
    if nvcc "${flags[@]}" $inc -c "$f" -o "$tmp/$name.o" >"$tmp/$name.log" 2>&1; then
      echo "  ok   $f ($(( $(date +%s) - t0 )) s)"
      grep -i "spill" "$tmp/$name.log" | grep -v " 0 bytes spill" || true
    else
      echo "  FAIL $f"; cat "$tmp/$name.log"; exit 1
    fi ) &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "compile_cuda: $([ $rc = 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
exit $rc
