#!/usr/bin/env bash
# The GPU host's side of the vLLM 0.32.0 bundle, or 0.33.0's (VLLM_RELEASE below; bundle.py
# builds both; README.md has the steps). In the checkout's root on the GPU host:
#   bash benchmarks/gpu/offline/install_bundle.sh SUB     SUB is one of
#     facts      python, GPU, the image's CUDA wheels
#     collect    the .bundle/cNN parts copied so far -> /tmp (and a detached bench's progress)
#     unpack     reassemble the parts, verify every wheel
#     install    unpack, pip --target, link CUDA libs, check
#     check      import vllm, CUDA, vLLM's ops, the plugin
#     gputests   the GPU tests that need vLLM
#     installed  exit 0 if `install` has run on this host
#     env        exports for vllm serve / bench: eval "$(bash .../install_bundle.sh env)"
# Everything lives under /tmp (the VLLM_* variables below move it), so parts can be copied and
# collected one at a time. vLLM runs on the image's torch 2.11 unless the torch group (torch
# 2.13, triton 3.7.1) was collected: it is, only if check fails on the image's torch
# (device_image.py TORCH_STACK).
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$0")/../../.."
REPO=$PWD
# VLLM_RELEASE=0.33.0 before every command: vLLM 0.33's bundle (bundle.py --vllm 0.33.0: core
# alone), its own manifest, parts folder and folders under /tmp (the marker is the host's).
case ${VLLM_RELEASE:-0.32.0} in
  0.32.0) TAG= ;;
  0.33.0) TAG=-vllm0.33.0 ;;
  *) echo "VLLM_RELEASE=$VLLM_RELEASE: no bundle for it (bundle.py RELEASES: 0.32.0, 0.33.0)"
     exit 2 ;;
esac
MANIFEST=$(realpath "${VLLM_MANIFEST:-benchmarks/gpu/offline/bundle_manifest${TAG/-/_}.txt}")
BUNDLE=${VLLM_BUNDLE_DIR:-.bundle$TAG}     # where the copied parts lie (.bundle/cNN)
PARTS=${VLLM_PARTS:-/tmp/vllm_parts$TAG}   # parts gathered, one collect after another
WHEELS=${VLLM_WHEELS:-/tmp/vllm_wheels$TAG}   # the reassembled tars, unpacked
SITE=${VLLM_SITE:-/tmp/vllm_site$TAG}      # pip --target: goes first on PYTHONPATH
MARKER=${VLLM_MARKER:-/tmp/vllm_bundle.marker}   # a line per collect, either release
PY=${PYTHON:-python3}                      # the image's python (torch 2.11, nvidia-* wheels)
KNOBS_ENV=${KNOBS_ENV:-/tmp/chunkattn_knobs.env}   # knobs run_on_device.sh settled on this host
NCCL_MIN=2.29                              # torch 2.13 needs symbols NCCL 2.28 lacks (bundle.py)
COMPAT=$SITE/nccl_compat.so                # ... which nccl_compat.c defines, when it is preloaded

log() { echo "[install_bundle $(date +%T)] $*"; }
part_lines() { awk '$1 == "part" {print $3, $4, $5}' "$MANIFEST"; }    # name bytes sha, in order
parts_of() {   # the parts group $1's byte range touches: "name bytes sha from count"
  local off len pos=0 name bytes sha end
  read -r off len < <(awk -v g="$1" '$1 == "group" && $2 == g {print $3, $4}' "$MANIFEST")
  [ -n "$len" ] || { log "no group $1 in $MANIFEST"; return 1; }
  while read -r name bytes sha; do
    end=$((pos + bytes))
    if [ "$end" -gt "$off" ] && [ "$pos" -lt $((off + len)) ]; then
      local from=$(( off > pos ? off - pos : 0 ))
      local to=$(( off + len < end ? off + len - pos : bytes ))
      echo "$name $bytes $sha $from $((to - from))"
    fi
    pos=$end
  done < <(part_lines)
}
image_site() {
  env -u PYTHONPATH "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}
image_version() {   # the image's own version of a distribution, "" if absent
  env -u PYTHONPATH "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$1"
}
has_group() { awk -v g="$1" '$1 == "group" && $2 == g {f = 1} END {exit !f}' "$MANIFEST"; }
group_complete() {  # every part of group $1 collected (a group the manifest lacks never is)
  has_group "$1" || return 1
  local name; while read -r name _; do [ -f "$PARTS/$name" ] || return 1; done < <(parts_of "$1")
}
torch_carried() { group_complete torch; }   # else: the image's torch
c_compiler() { command -v gcc || command -v cc || command -v c++; }   # for nccl_compat.c
nccl_needed() {     # true unless the image's NCCL is already >= NCCL_MIN
  local v; v=$(image_version nvidia-nccl-cu13)
  [ -z "$v" ] && return 0
  "$PY" -c "import sys; from packaging.version import Version as V
sys.exit(0 if V(sys.argv[1]) < V(sys.argv[2]) else 1)" "$v" "$NCCL_MIN"
}

facts() {
  "$PY" -c 'import sys; print("python", sys.version.split()[0], sys.executable)'
  "$PY" -c 'import lzma' 2>/dev/null && echo "python lzma: ok (inflates the xz wheels)" \
    || echo "python lzma: MISSING: the xz wheels cannot be inflated (bundle.py XZ_MIN)"
  local cc; cc=$(c_compiler) && echo "C compiler: $cc" \
    || echo "C compiler: none: no nccl_compat shim, the nccl group must travel"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  local names='torch|triton|torchvision|torchaudio|transformers|huggingface.hub|tokenizers|numpy'
  names+='|nvidia-|cuda-|aiohttp|requests|pillow|protobuf|setuptools|typing.extensions|opencv'
  env -u PYTHONPATH "$PY" -m pip list --format=freeze 2>/dev/null | grep -iE "^($names)" \
    | tr '\n' ' '; echo
  df -h /tmp | tail -1
}

collect() {   # copy the part(s) in $BUNDLE to $PARTS and verify them at once
  mkdir -p "$PARTS"
  if [ -f "$MARKER" ]; then log "marker found: $(wc -l < "$MARKER") earlier collect(s) on this host"
  else log "no marker: the first collect on this host"; fi
  echo "$(date +%T) $(echo "$BUNDLE"/c*)" >> "$MARKER"
  local f name bytes sha
  for f in "$BUNDLE"/c*/bundle.part*; do
    [ -e "$f" ] || continue
    name=$(basename "$f")
    [ -f "$PARTS/$name.ok" ] && continue     # collected before, still in $BUNDLE
    read -r bytes sha < <(awk -v n="$name" '$1 == "part" && $3 == n {print $4, $5}' "$MANIFEST")
    cp "$f" "$PARTS/$name"
    if [ "$(sha256sum < "$PARTS/$name" | cut -d' ' -f1)" != "$sha" ]; then
      log "BAD checksum: $name (manifest and copied part differ: rebuild or copy it again)"
      rm -f "$PARTS/$name"; return 1
    fi
    touch "$PARTS/$name.ok"
    log "part $name ok ($bytes B)"
  done
  local g missing
  while read -r g; do
    missing=$(parts_of "$g" | while read -r name _; do
      [ -f "$PARTS/$name" ] || echo -n "$name "; done)
    log "group $g: ${missing:+missing }${missing:-complete}${missing:+$(case $g in
      torch) echo "(copied only if install's check fails on the image's torch)" ;;
      nccl) echo "(copied only with torch, if install's NCCL check fails with nccl_compat.c)" ;;
      esac)}"
  done < <(awk '$1 == "group" {print $2}' "$MANIFEST")
  bash benchmarks/gpu/detached_bench.sh status   # the kernel bench, if one runs beside the copies
}

assemble() {  # group -> $WHEELS; parts checked again: one bad byte must not reach pip
  local group=$1 name bytes sha from count
  mkdir -p "$WHEELS"
  while read -r name bytes sha _; do
    [ -f "$PARTS/$name" ] || { log "missing part $name (group $group)"; return 1; }
    [ "$(sha256sum < "$PARTS/$name" | cut -d' ' -f1)" = "$sha" ] \
      || { log "BAD checksum: $name"; return 1; }
  done < <(parts_of "$group")
  parts_of "$group" | while read -r name _ _ from count; do
    dd if="$PARTS/$name" iflag=skip_bytes,count_bytes skip="$from" count="$count" bs=4M status=none
  done | tar -x -C "$WHEELS"
  (cd "$WHEELS" && sha256sum --quiet -c "SHA256SUMS.$group") && log "group $group: wheels verified"
}

reserve_needed() {  # reserve wheels whose package the image lacks or has at a failing version
  env -u PYTHONPATH "$PY" - "$MANIFEST" <<'PY'
import importlib.metadata as md, sys
from packaging.specifiers import SpecifierSet
from packaging.version import Version
for line in open(sys.argv[1]):
    f = line.split()
    if not f or f[0] != "reserve":
        continue
    _, wheel, name, spec = f
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or not SpecifierSet(spec).contains(Version(have), prereleases=True):
        print(f"reserve/{wheel}")
        print(f"  reserve {name}: image has {have}, needs {spec}", file=sys.stderr)
PY
}

unpack() {
  local t0=$SECONDS
  rm -rf "$WHEELS"
  assemble core
  if ! torch_carried; then
    log "torch group not carried: vLLM on the image's torch $(image_version torch)" \
        "(its extensions use torch's stable C ABI: device_image.py TORCH_STACK)"
  else
    assemble torch
    if ! nccl_needed; then log "image NCCL >= $NCCL_MIN: nccl group not needed"
    elif group_complete nccl; then assemble nccl
    else log "nccl group not carried: the image's NCCL $(image_version nvidia-nccl-cu13)" \
             "with nccl_compat.c preloaded"; fi
  fi
  "$PY" benchmarks/gpu/offline/recompress.py inflate "$WHEELS"     # big wheels travel as xz
  log "unpacked in $((SECONDS - t0)) s"
}

nccl_compat() {     # torch 2.13's shim, unless NCCL 2.29 came in the nccl group (a real folder)
  rm -f "$COMPAT"
  if torch_carried && nccl_needed && [ -L "$SITE/nvidia/nccl" ]; then
    local cc; cc=$(c_compiler || true)
    if [ -z "$cc" ]; then log "no C compiler for nccl_compat.c: carry the nccl group"; return 0; fi
    "$cc" -x c -shared -fPIC -O2 -o "$COMPAT" benchmarks/gpu/offline/nccl_compat.c
    log "built $COMPAT with $cc: preloaded by 'env' (torch 2.13 over the image's NCCL)"
  fi
}

install() {
  local img t0 wheels
  # The inflating takes every core: not while a detached bench is timing (detached_bench.sh).
  bash benchmarks/gpu/detached_bench.sh wait
  t0=$SECONDS
  img=$(image_site)
  unpack
  mapfile -t reserve < <(cd "$WHEELS" && reserve_needed)
  wheels=("$WHEELS"/wheels/*.whl)
  for r in "${reserve[@]}"; do wheels+=("$WHEELS/$r"); done
  rm -rf "$SITE"
  # One pip call: --target moves each top-level folder once, so shared namespaces (google/,
  # nvidia/, opentelemetry/) must come from the same call.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-warn-conflicts \
    --target "$SITE" "${wheels[@]}"
  log "pip --target $SITE: ${#wheels[@]} wheels in $((SECONDS - t0)) s"
  link_cuda_libs "$img"
  nccl_compat
  register_plugin
  check
}

link_cuda_libs() {  # torch's RPATH is $ORIGIN/../../nvidia/{cu13,cudnn,nccl,...}/lib
  local img=$1 d
  mkdir -p "$SITE/nvidia"
  for d in "$img"/nvidia/*/; do
    d=${d%/}
    if [ -e "$SITE/nvidia/$(basename "$d")" ]; then log "nvidia/$(basename "$d"): carried"
    else ln -s "$d" "$SITE/nvidia/$(basename "$d")"; fi
  done
  log "CUDA libraries in $SITE/nvidia: $(cd "$SITE/nvidia" && echo *)" \
      "(carried, or links to $img/nvidia)"
}

register_plugin() {  # the entry point vLLM reads; the code itself comes from the repo on PYTHONPATH
  local di="$SITE/vllm_chunkattn-0.1.0.dist-info"
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm-chunkattn\nVersion: 0.1.0\n' > "$di/METADATA"
  printf '[vllm.general_plugins]\nchunkattn = vllm_chunkattn.plugin:register\n' \
    > "$di/entry_points.txt"
  : > "$di/RECORD"
}

print_env() {
  cat <<EOF
export PYTHONPATH=$SITE:$REPO\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$SITE/bin:\$PATH
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1   # cuDNN 9.19 (image) under torch built on 9.20
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# FlashInfer is not in the bundle, and vLLM 0.32's V2 model runner imports its FlashInfer
# attention backend to choose a sampler unless this is 0 (without it the engine dies on
# "No module named 'flashinfer'"); stock and CUSTOM then sample with the same PyTorch sampler.
export VLLM_USE_FLASHINFER_SAMPLER=0
export CHUNKATTN_BUILD_DIR=\${CHUNKATTN_BUILD_DIR:-/tmp/chunkattn_jit} MAX_JOBS=\${MAX_JOBS:-16}
EOF
  if [ -f "$COMPAT" ]; then echo "export LD_PRELOAD=$COMPAT\${LD_PRELOAD:+:\$LD_PRELOAD}"; fi
  # knobs a run of the kernel's GPU tests settled on this host (run_on_device.sh: overlap_fallback)
  if [ -f "$KNOBS_ENV" ]; then cat "$KNOBS_ENV"; fi
}

check() {
  eval "$(print_env)"
  TORCH_CARRIED=$(torch_carried && echo 1 || echo 0) "$PY" benchmarks/gpu/offline/install_check.py "$MANIFEST"
}

# The GPU tests that import vLLM skip in run_on_device.sh (the image has none): builder + forward
# with no host sync, and FULL decode graphs replaying each step's tree through the builder.
# All of them must pass here: a skip is a failure.
gputests() {
  bash benchmarks/gpu/detached_bench.sh wait     # the GPU is a detached bench's until it ends
  eval "$(print_env)"
  local files last
  mapfile -t files < <(grep -l -E "mark\.gpu" tests/*/test_*.py | xargs grep -l 'importorskip("vllm")')
  log "GPU tests under vLLM: ${files[*]}"
  "$PY" -m pytest -q -rfEs -p no:cacheprovider -m gpu "${files[@]}" 2>&1 \
    | tee /tmp/vllm_gputests.log || true      # judged by its last line below
  last=$(tail -1 /tmp/vllm_gputests.log)
  if [[ $last == *passed* && $last != *failed* && $last != *error* && $last != *skipped* ]]; then
    log "GPU tests under vLLM: OK ($last)"
  else
    log "GPU tests under vLLM: FAILED ($last)"; return 1
  fi
}

case "${1:-}" in
  facts) facts ;;
  collect) collect ;;
  unpack) unpack ;;
  install) install ;;
  check) check ;;
  gputests) gputests ;;
  installed) [ -d "$SITE" ] ;;
  env) print_env ;;
  *) sed -n '2,16p' "$SELF"; exit 2 ;;
esac
