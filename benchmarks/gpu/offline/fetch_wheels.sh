#!/usr/bin/env bash
# Downloads the FlashInfer baseline for a GPU host without network (Python 3.12, x86-64) into
# benchmarks/gpu/offline/wheels/, which git ignores; copy that folder to the host with the checkout:
#   flashinfer-python 0.6.14 (py3-none-any) + apache-tvm-ffi 0.1.15.post2 (cp312), ~17 MiB.
# FlashInfer JIT-compiles its kernels and binds them through tvm-ffi, so no torch ABI has to
# match (the project's GPU baseline notes). run_on_device.sh installs them when present.
# Usage: bash benchmarks/gpu/offline/fetch_wheels.sh   (PYTHON=... to pick the pip; run it on a
# machine with network). Then `python benchmarks/gpu/offline/flashinfer_aot.py build` compiles the
# bench's FlashInfer modules for sm_90a into the same folder, so the GPU host does not wait on nvcc.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
mkdir -p wheels
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d wheels \
  flashinfer-python==0.6.14 apache-tvm-ffi==0.1.15.post2
# One version of each: two would stop the install on the GPU host.
for name in flashinfer_python apache_tvm_ffi; do
  n=$(find wheels -name "${name}-*.whl" | wc -l)
  [ "$n" -eq 1 ] || { echo "fetch_wheels: $n wheels of $name in $(pwd)/wheels, want 1" >&2; exit 1; }
done
du -sh wheels && ls -l wheels
