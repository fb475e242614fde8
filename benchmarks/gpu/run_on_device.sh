#!/usr/bin/env bash
# One shot on a lent GPU (device tool `run`, repo root, outputs under $OUT):
#   bash benchmarks/gpu/run_on_device.sh
# JIT-builds csrc/ for the local arch, runs the CUDA + host tests, then the benchmarks.
# Everything it prints is also in $OUT: build.log, tests.log, bench.log, microbench_*.json,
# bench/kernel_cuda.{csv,md,png} (8 files: the device tool returns at most 8).
set -uo pipefail
OUT=${OUT:-/tmp/chunkattn_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CHUNKATTN_BUILD_DIR=${CHUNKATTN_BUILD_DIR:-/tmp/chunkattn_jit} MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  nvcc --version | tail -1
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/build.log"

echo "== JIT build" | tee -a "$OUT/build.log"
$PY - <<'PY' 2>&1 | tee -a "$OUT/build.log"
import time, torch
t = time.time()
from vllm_chunkattn.ops.jit_build import load_jit
from pathlib import Path
load_jit(Path("csrc"), verbose=True)
print(f"jit build+load: {time.time() - t:.1f} s")
import torch._C as C
print("CUDA kernel registered:", C._dispatch_has_kernel_for_dispatch_key("chunkattn::tpp_decode", "CUDA"))
PY
build_rc=${PIPESTATUS[0]}

echo "== tests" | tee "$OUT/tests.log"
$PY -m pytest -q -rs --timeout=300 -p no:cacheprovider tests/test_ops_cuda.py 2>&1 | tee -a "$OUT/tests.log"
test_rc=${PIPESTATUS[0]}
$PY -m pytest -q -p no:cacheprovider tests/test_cuda_host.py 2>&1 | tail -3 | tee -a "$OUT/tests.log"

echo "== kernel microbench" | tee "$OUT/bench.log"
for dtype in bfloat16 float16; do
  $PY benchmarks/gpu/tpp_microbench.py --dtype $dtype --out "$OUT/microbench_$dtype.json" 2>&1 | tee -a "$OUT/bench.log"
done
echo "== vllm_chunkattn.bench kernel --device cuda" | tee -a "$OUT/bench.log"
$PY -m vllm_chunkattn.bench kernel --device cuda --out "$OUT/bench" 2>&1 | tail -40 | tee -a "$OUT/bench.log"

echo "build rc=$build_rc tests rc=$test_rc" | tee -a "$OUT/tests.log"
exit $(( build_rc != 0 || test_rc != 0 ))
