#!/usr/bin/env bash
# The CUDA kernel built, tested and measured on one NVIDIA GPU, from the repo root (README.md):
#   env -> FlashInfer (installed, or from offline/wheels) -> JIT build -> GPU tests -> host-side
#   CUDA tests -> compute-sanitizer memcheck + racecheck on small trees -> FlashInfer JIT warm-up
#   -> tree grids vs FlashInfer (bench kernel --grid gpu) -> decode TPOT -> microbench -> bench
#   kernel goals / full grid.
# Every stage gets at most its cap and what is left of TIME_LIMIT_S (default 470 s), so the
# script ends in under 8 minutes whatever hangs; the summary names each stage ok / FAILED / CUT /
# SKIPPED. Everything lands in $WORK; $OUT gets at most 8 files: the summary, the logs worth
# reading first, the result tables and results.tar.gz of it all.
# Exit status: 1 when the build, a test or the sanitizer failed (bench failures: see summary).
# Knobs: TIME_LIMIT_S, STAGES ("tests sanitizer bench"; add ncu for Nsight Compute counters at
# the points furthest from their goals, ncu_points.py), FULL_GRID_MIN_S (200), PYTHON, MAX_JOBS.
# STAGES may add flashinfer-warm: FlashInfer's JIT build started detached (it outlives the
# script), so a later STAGES=bench run finds it built (it waits for it if not done); or
# bench-detach: the whole bench stage detached (detached_bench.sh), collected later.
set -uo pipefail
OUT=${OUT:-/tmp/chunkattn_out}
WORK=${WORK:-/tmp/chunkattn_run}
PY=${PYTHON:-python3}
rm -rf "$WORK" && mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CHUNKATTN_BUILD_DIR=${CHUNKATTN_BUILD_DIR:-/tmp/chunkattn_jit} MAX_JOBS=${MAX_JOBS:-16}
export CHUNKATTN_NVCC_FLAGS=${CHUNKATTN_NVCC_FLAGS:--Xptxas=-v}   # registers / spills in build.log
DEADLINE=$(( $(date +%s) + ${TIME_LIMIT_S:-470} ))
STAGES=${STAGES:-"tests sanitizer bench"}    # e.g. STAGES=bench to rerun the benchmarks alone
SUMMARY="$WORK/summary.txt"
KNOBS_ENV=${KNOBS_ENV:-/tmp/chunkattn_knobs.env}  # knobs the GPU tests settled for later runs
FAILED=0
WARM_STATE=${WARM_STATE:-/tmp/flashinfer_warm}   # .pid / .log of a detached warm-up
FI_WHEELS=${FI_WHEELS:-benchmarks/gpu/offline/wheels}   # FlashInfer's wheels, for a host
FI_SITE=${FI_SITE:-/tmp/site}                     # without network: installed there (pip --target)
# FlashInfer's d = 128 modules for both dtypes, built in parallel (half the cores each: cutlass
# units take GBs of host memory apiece) by running each wrapper once.
# shellcheck disable=SC2016  # expanded by the inner bash
WARM_CMD=(env PY="$PY" MAX_JOBS=$(( (MAX_JOBS + 1) / 2 )) bash -c '
  "$PY" -m vllm_chunkattn.bench.flashinfer_baselines --warm float16 & fp16=$!
  "$PY" -m vllm_chunkattn.bench.flashinfer_baselines --warm bfloat16 & bf16=$!
  wait $fp16; a=$?; wait $bf16; b=$?; exit $(( a | b ))')

# stage NAME CAP_S LOG CMD...: CMD's output to LOG and the console, cut at min(CAP_S, time
# left); one summary line. Returns CMD's status (124 when cut).
stage() {
  local name=$1 cap=$2 log=$3 left status t0 rc
  shift 3
  left=$(( DEADLINE - $(date +%s) ))
  if (( left < 15 )); then
    printf '%-22s SKIPPED (time limit reached)\n' "$name" >> "$SUMMARY"
    return 124
  fi
  (( cap > left )) && cap=$left
  echo "== $name (at most ${cap} s)" | tee -a "$log"
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124|137) status="CUT at ${cap} s" ;;
    75) status="UNSUPPORTED here" ;;     # the tool refused this machine (see the log)
    5) status="none selected" ;;         # pytest: every test deselected
    *) status="FAILED (rc $rc)" ;;
  esac
  printf '%-22s %-18s %4d s\n' "$name" "$status" $(( $(date +%s) - t0 )) >> "$SUMMARY"
  return "$rc"
}

# ---- the machine
# shellcheck disable=SC2016  # expanded by the inner bash
stage env 60 "$WORK/env.log" env PY="$PY" bash -c '
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  nvcc --version | tail -1
  "$PY" -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
    torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  "$PY" -c "from torch.utils import cpp_extension as c; print(\"CUDA_HOME (torch guess)\", c.CUDA_HOME)"
  "$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|triton|pytest|flashinfer|apache-tvm-ffi) "
  # The host compiler of the JIT build (on the GPU image a wrapper that linked libstdc++ statically)
  cxx=$("$PY" -c "from torch.utils.cpp_extension import get_cxx_compiler as c; print(c())" 2>/dev/null || echo c++)
  echo "C++ compiler $cxx: $("$cxx" --version | head -1)"
  nproc; free -g | head -2'

# ---- FlashInfer, the baseline: installed (pip install flashinfer-python), or from the wheels
# offline/fetch_wheels.sh downloads for a host without network, into $FI_SITE
fi_ok=0
if compgen -G "$FI_WHEELS/*.whl" > /dev/null; then
  # Installed once per host: a detached warm-up (flashinfer-warm) may still be compiling from
  # $FI_SITE, which a reinstall would pull from under it.
  stamp=$(stat -c '%s %n' "$FI_WHEELS"/*.whl | sha256sum | cut -c1-16)
  if [ "$(cat "$FI_SITE/.wheels_stamp" 2>/dev/null)" = "$stamp" ]; then
    printf '%-22s ok (installed by an earlier run)\n' flashinfer >> "$SUMMARY"; fi_ok=1
  elif stage flashinfer 120 "$WORK/env.log" "$PY" -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target "$FI_SITE" "$FI_WHEELS"/*.whl; then
    echo "$stamp" > "$FI_SITE/.wheels_stamp"; fi_ok=1
  fi
elif [ -f "$FI_SITE/.wheels_stamp" ]; then   # the wheels gone since an earlier run installed them
  printf '%-22s ok (installed by an earlier run; no wheels now)\n' flashinfer >> "$SUMMARY"
  fi_ok=1
elif "$PY" -c "import flashinfer" 2>/dev/null; then
  printf '%-22s ok (installed)\n' flashinfer >> "$SUMMARY"; fi_ok=1
else
  printf '%-22s SKIPPED (not installed: pip install flashinfer-python, or offline/fetch_wheels.sh)\n' \
    flashinfer >> "$SUMMARY"
fi
if (( fi_ok )); then
  export PYTHONPATH="$FI_SITE:$PYTHONPATH"
  FLASHINFER_CUDA_ARCH_LIST=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m == 9 else ''))")
  export FLASHINFER_CUDA_ARCH_LIST
  # FA3-based paths include curand_kernel.h; torch's nvidia-curand wheel has it if CUDA lacks it.
  if [ ! -f "${CUDA_HOME:-/usr/local/cuda}/include/curand_kernel.h" ]; then
    curand=$("$PY" -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null)
    inc=$(find "${curand:-/nonexistent}/nvidia" -name curand_kernel.h -printf '%h\n' 2>/dev/null | head -1)
    [ -n "$inc" ] && export FLASHINFER_EXTRA_CUDAFLAGS="-I$inc"
  fi
  "$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tee -a "$WORK/env.log"
  # The bench's modules compiled ahead of time (offline/flashinfer_aot.py build; the pack lies in
  # the wheels folder): FlashInfer loads them instead of building (60-112 s of nvcc).
  aot=$("$PY" benchmarks/gpu/offline/flashinfer_aot.py install --site "$FI_SITE" \
        --tar "$FI_WHEELS/flashinfer_aot_sm90a.tar.xz" --arch "$FLASHINFER_CUDA_ARCH_LIST" 2>&1 |
        tee -a "$WORK/env.log" | tail -1)
  printf '%-22s %s\n' flashinfer-aot "$aot" >> "$SUMMARY"
fi

# ---- build (JIT, local arch; sm_90a on Hopper)
stage build 240 "$WORK/build.log" "$PY" - <<'PY'
import time
from pathlib import Path

import torch

t = time.time()
from vllm_chunkattn.ops.jit_build import load_jit
load_jit(Path("csrc"), verbose=True)
print(f"jit build+load: {time.time() - t:.1f} s")
print("CUDA kernel registered:",
      torch._C._dispatch_has_kernel_for_dispatch_key("chunkattn::tpp_decode", "CUDA"))
import subprocess
for lib in torch.ops.loaded_libraries:       # a private static libstdc++ segfaults on TORCH_CHECK
    if "vllm_chunkattn_jit" in lib:
        deps = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
        print("libstdc++:", "shared" if "libstdc++.so" in deps else "NOT shared (a static copy)")
PY
build_rc=$?
grep -E "registers|spill|bytes stack" "$WORK/build.log" | sort -u > "$WORK/ptxas.txt"
grep -h "^libstdc++:" "$WORK/build.log" >> "$SUMMARY"

want() { [[ " $STAGES " == *" $1 "* ]]; }
# find_tool NAME PATH...: NAME on PATH, else the first executable of the (globbed) paths; empty
# if none (the image keeps CUDA's tools outside PATH).
find_tool() {
  local found c
  found=$(command -v "$1")
  shift
  for c in "$@"; do [ -z "$found" ] && [ -x "$c" ] && found=$c; done
  echo "$found"
}
# junit_counts NAME XML: "NAME: P passed, F failed, E errors, S skipped" into the summary;
# status 1 when nothing passed.
junit_counts() { "$PY" benchmarks/gpu/junit.py counts "$1" "$2" >> "$SUMMARY"; }

# Knobs a run of the GPU tests settled for later runs on this host (the bench, serve_ab.sh's
# servers): a run that runs the tests decides them afresh.
# shellcheck disable=SC1090  # written by overlap_fallback below
if want tests; then rm -f "$KNOBS_ENV"; elif [ -f "$KNOBS_ENV" ]; then . "$KNOBS_ENV"; fi

# overlap_fallback: the GPU tests failed. If every failed test passes again with the final
# launch serialised (CHUNKATTN_OVERLAP_FINAL=0; the tests that force the overlap on are left
# out), the overlapped launch alone is wrong on this GPU: the knob goes off for this run and
# later ones on this host (exported, and in $KNOBS_ENV), and the bench still runs instead of
# being lost to it. Status 1 when something else failed.
overlap_fallback() {
  local ids rc
  mapfile -t ids < <("$PY" benchmarks/gpu/junit.py failed "$WORK/tests_gpu.xml" 2>/dev/null)
  (( ${#ids[@]} )) || return 1              # no XML, or nothing failed: pytest itself broke
  # shellcheck disable=SC2086
  CHUNKATTN_OVERLAP_FINAL=0 stage gpu-tests-final-serial 150 "$WORK/tests.log" "$PY" -m pytest \
    -q -rfEs -p no:cacheprovider -m "gpu and not overlap_on" $xdist $ptimeout \
    --junitxml="$WORK/tests_gpu_final_serial.xml" "${ids[@]}"
  rc=$?
  (( rc == 0 || rc == 5 )) || return 1      # 5: every failed test forced the overlap on
  export CHUNKATTN_OVERLAP_FINAL=0
  echo "export CHUNKATTN_OVERLAP_FINAL=0" > "$KNOBS_ENV"
  printf '%-22s OFF for this host: the %d failed GPU tests pass with CHUNKATTN_OVERLAP_FINAL=0 or force the overlap on (%s)\n' \
    overlap-final "${#ids[@]}" "$KNOBS_ENV" >> "$SUMMARY"
}
if (( build_rc == 0 )); then
  # ---- FlashInfer's JIT build, detached and niced, started before the tests: it compiles on
  # the cores the GPU tests and the sanitizer leave free, and runs on after this script ends, so
  # a later bench finds its modules cached (~/.cache/flashinfer) instead of waiting on nvcc
  if want flashinfer-warm && "$PY" -c "import flashinfer" 2>/dev/null; then
    setsid nohup nice -n 15 timeout 300 "${WARM_CMD[@]}" > "$WARM_STATE.log" 2>&1 < /dev/null &
    echo $! > "$WARM_STATE.pid"
    printf '%-22s started detached (pid %s, %s.log)\n' flashinfer-warm $! "$WARM_STATE" >> "$SUMMARY"
  fi

  # ---- tests: every GPU test (the files that mark any), then the host-side CUDA tests
  xdist=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
  ptimeout=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=150")
  if want tests; then
    gpu_files=$(grep -l -E "mark\.gpu" tests/*/test_*.py)
    # shellcheck disable=SC2086  # word splitting of the optional flags and file list
    stage gpu-tests 200 "$WORK/tests.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
      -m "gpu and not timeline" $xdist $ptimeout --junitxml="$WORK/tests_gpu.xml" $gpu_files \
      || overlap_fallback || FAILED=1
    # shellcheck disable=SC2086
    stage host-tests 90 "$WORK/tests.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider $xdist \
      --junitxml="$WORK/tests_host.xml" tests/kernels/test_cuda_contract.py \
      || FAILED=1
    # A run where every GPU test skipped (torch saw no GPU) exits 0 but tested nothing.
    if ! junit_counts gpu-tests "$WORK/tests_gpu.xml"; then
      FAILED=1
      printf '%-22s FAILED (not one GPU test ran: see the skip reasons in tests.log)\n' \
        gpu-tests-ran >> "$SUMMARY"
    fi
    junit_counts host-tests "$WORK/tests_host.xml"
    # The profiler's timeline of the overlap: a performance property, reported, never gating
    # (the bench's "final not overlapped" column measures the same).
    # shellcheck disable=SC2086
    stage overlap-timeline 60 "$WORK/tests.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
      -m "gpu and timeline" --junitxml="$WORK/tests_timeline.xml" $gpu_files \
      || printf '%-22s (not gating: the final kernel did not start inside the partial one)\n' \
        overlap-timeline >> "$SUMMARY"
  fi

  # ---- compute-sanitizer on a few small trees: our kernels only, and no caching allocator, so
  # an access past a tensor leaves its allocation
  SAN=$(find_tool compute-sanitizer /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer)
  # sanitize.sh: rc 99 the tool found an error, 75 it refused this machine (no verdict).
  if want sanitizer && [ -n "$SAN" ]; then
    for tool in memcheck racecheck; do
      stage "sanitizer-$tool" 120 "$WORK/sanitizer.log" bash benchmarks/gpu/sanitize.sh \
        "$SAN" "$tool" "$PY" || { (( $? == 75 )) || FAILED=1; }
    done
  elif want sanitizer; then
    printf '%-22s SKIPPED (compute-sanitizer not found)\n' sanitizer >> "$SUMMARY"
  fi

  # ---- the benchmarks below, detached (detached_bench.sh): they run on after this script ends
  # (e.g. while the offline bundle is copied), and only for a kernel whose tests and sanitizer
  # passed
  if want bench-detach; then
    if (( FAILED )); then
      printf '%-22s SKIPPED (a test or the sanitizer failed)\n' bench-detach >> "$SUMMARY"
    else
      msg=$(bash benchmarks/gpu/detached_bench.sh start 2>&1)
      printf '%-22s %s\n' bench-detach "${msg#detached bench: }" >> "$SUMMARY"
    fi
  fi

  # ---- benchmarks (bench kernel: cold L2, CUDA events, median; microbench: graph replay)
  if want bench; then
    # FlashInfer JIT-builds its decode and FA3 prefill modules on first use (~1-3 min on a fresh
    # machine, cached in ~/.cache/flashinfer while it stays warm): build both dtypes first, in
    # parallel (half the cores each: cutlass units take GBs of host memory apiece), so no timing
    # below waits on nvcc.
    if "$PY" -c "import flashinfer" 2>/dev/null; then
      warm_pid=$(cat "$WARM_STATE.pid" 2>/dev/null)
      if [ -n "$warm_pid" ] && kill -0 "$warm_pid" 2>/dev/null; then   # an earlier run's
        stage flashinfer-wait 240 "$WORK/bench.log" \
          bash -c "while kill -0 $warm_pid 2>/dev/null; do sleep 1; done"
      fi
      [ -f "$WARM_STATE.log" ] && cat "$WARM_STATE.log" >> "$WORK/bench.log"
      stage flashinfer-jit 240 "$WORK/bench.log" "${WARM_CMD[@]}"     # seconds once cached
      # What FlashInfer still compiled here (0 when flashinfer-aot held every module it used).
      printf '%-22s %s module(s) compiled on the device\n' flashinfer-built "$(find \
        "${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer" -path '*/cached_ops/*' \
        -name '*.so' 2>/dev/null | wc -l)" >> "$SUMMARY"
    fi
    # The tree grids (paper Table 3, Llama-3-8B, RL rollouts, few-shot) against
    # FlashInfer decode + cascade: kernel_cuda_gpu.{md,csv,png}, rewritten after every grid.
    stage bench-trees 300 "$WORK/bench.log" "$PY" -m vllm_chunkattn.bench kernel --device cuda \
      --grid gpu --out "$WORK/bench"
    # Decode TPOT on paper: Llama-3-8B and Qwen2.5-32B shapes at B 32/128/256, our
    # attention vs FlashInfer decode plus the measured linear layers: tpot_cuda.{md,csv,png}.
    stage tpot 150 "$WORK/bench.log" "$PY" -m vllm_chunkattn.bench tpot --device cuda \
      --out "$WORK/bench"
    # The same at serve_ab.sh's rows (2208 prompt tokens, 2048 of them shared or none, + 128
    # generated on average): the prediction set beside a served A/B on the same GPU.
    stage tpot-serve 60 "$WORK/bench.log" "$PY" -m vllm_chunkattn.bench tpot --device cuda \
      --shapes llama-3-8b --batch 32,128,256 --shared 0,2048 --prompt 2208 --private 128 \
      --tag serve --out "$WORK/bench"
    for dtype in bfloat16 float16; do
      stage "microbench-$dtype" 60 "$WORK/bench.log" "$PY" benchmarks/gpu/tpp_microbench.py \
        --dtype "$dtype" --out "$WORK/microbench_$dtype.json"
    done
    stage bench-goals 120 "$WORK/bench.log" "$PY" -m vllm_chunkattn.bench kernel --device cuda \
      --grid goals --out "$WORK/bench"
    # The full grid writes its files only at the end: start it only with time to finish.
    if (( DEADLINE - $(date +%s) >= ${FULL_GRID_MIN_S:-200} )); then
      stage bench-full 300 "$WORK/bench.log" "$PY" -m vllm_chunkattn.bench kernel --device cuda \
        --grid full --reps 5 --out "$WORK/bench"
    else
      printf '%-22s SKIPPED (< %s s left: run STAGES=bench on its own)\n' bench-full \
        "${FULL_GRID_MIN_S:-200}" >> "$SUMMARY"
    fi
  fi
  # ---- Nsight Compute on the points furthest from their goals (ncu_points.py), a process each
  if want ncu; then
    NCU=$(find_tool ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu)
    if [ -n "$NCU" ]; then
      # The served shape first: the time limit cuts the last stages.
      for pt in llama_serve paper_shared paper_private llama_capacity; do
        stage "ncu-$pt" 90 "$WORK/ncu.log" "$NCU" --clock-control none --target-processes all \
          -k regex:tpp_ --section SpeedOfLight --section Occupancy --section LaunchStats \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
          --csv --page details \
          --log-file "$WORK/ncu_$pt.csv" "$PY" benchmarks/gpu/ncu_points.py "$pt"
      done
      # What the launches wait on: each stall reason's warps per issued instruction (the
      # sections above name only the top one), at the served shape (math pipe throttle: the
      # tensor pipe is the ceiling; short scoreboard / MIO: shared memory; long scoreboard: L2;
      # barrier: the stage syncs) and the two latency-bound points. A stage of its own, so a
      # metric this ncu lacks fails it alone.
      for pt in llama_serve paper_shared llama_capacity; do
        stage "ncu-stalls-$pt" 60 "$WORK/ncu.log" "$NCU" --clock-control none --target-processes all \
          -k regex:tpp_ --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
          --csv --page details --log-file "$WORK/ncu_stalls_$pt.csv" "$PY" benchmarks/gpu/ncu_points.py "$pt"
      done
      "$PY" benchmarks/gpu/ncu_points.py --summary "$WORK"/ncu_*.csv > "$WORK/ncu.md" 2>&1
    else
      printf '%-22s SKIPPED (ncu not found)\n' ncu >> "$SUMMARY"
    fi
  fi
else
  FAILED=1
  printf '%-22s SKIPPED (build failed)\n' tests sanitizer bench >> "$SUMMARY"
fi

# ---- $OUT (at most 8 files): summary, logs, tables, everything as a tarball
{
  echo "== summary ($(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo no-git))"
  cat "$SUMMARY"
  echo "== tests"; grep -h -E "passed|failed|error" "$WORK/tests.log" 2>/dev/null | grep -E "^=|in [0-9.]+s" | tail -4
  echo "== sanitizer"; grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|rel err" "$WORK/sanitizer.log" 2>/dev/null
  echo "== ptxas (registers / spills)"; head -12 "$WORK/ptxas.txt"
  echo "== microbench (us, graph replay: tree plan vs the same kernel with the empty plan)"
  grep -h '^{"shape"' "$WORK/bench.log" 2>/dev/null | "$PY" -c "
import json, sys
for r in map(json.loads, sys.stdin):
    warm = ' (KV fits in L2: timed warm)' if r.get('no_sharing_l2_resident') or r.get('tpp_l2_resident') else ''
    print(f\"{r['dtype']:9s} {r['shape']:32s} tpp {r['tpp_us']:9.1f}  no_sharing {r['no_sharing_us']:9.1f}  x{r['speedup']}{warm}\")"
  echo "== decode TPOT on paper (tpot_cuda.md, in results.tar.gz)"
  grep -E '^\| (llama|qwen)' "$WORK/bench/tpot_cuda.md" 2>/dev/null
  [ -f "$WORK/ncu.md" ] && { echo "== Nsight Compute (ncu_points.py)"; cat "$WORK/ncu.md"; }
  echo "== tree grids (kernel_cuda_gpu.md): goals"
  sed -n '/^## Goals/,/^## Method/p' "$WORK/bench/kernel_cuda_gpu.md" 2>/dev/null | grep '^- '
} > "$WORK/summary.md" 2>&1
cp "$WORK/summary.md" "$OUT/summary.md"
for f in tests.log sanitizer.log build.log; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
for f in "$WORK"/bench/kernel_cuda_gpu.md "$WORK"/bench/kernel_cuda_goals.md "$WORK"/bench/kernel_cuda.md; do
  [ -f "$f" ] && cp "$f" "$OUT/"
done
tar -czf "$OUT/results.tar.gz" -C "$WORK" .
ls -l "$OUT"
cat "$OUT/summary.md"
exit $(( FAILED != 0 ))
