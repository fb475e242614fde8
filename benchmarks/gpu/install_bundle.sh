#!/usr/bin/env bash
# Device side of the vLLM 0.32.0 bundle (bundle.py builds it; README.md has the call sequence).
# Run in the repo root on the lent GPU machine:
#   bash benchmarks/gpu/install_bundle.sh facts      # python, GPU, the image's CUDA wheels
#   bash benchmarks/gpu/install_bundle.sh collect    # this call's .bundle/cNN part -> /tmp, marker
#                                                    # (and a detached bench's progress)
#   bash benchmarks/gpu/install_bundle.sh unpack     # reassemble the parts, verify every wheel
#   bash benchmarks/gpu/install_bundle.sh install    # unpack, pip --target, link CUDA libs, check
#   bash benchmarks/gpu/install_bundle.sh check      # import vllm, CUDA, vLLM's ops, the plugin
#   bash benchmarks/gpu/install_bundle.sh gputests   # the GPU tests that need vLLM (#9's goals)
#   eval "$(bash benchmarks/gpu/install_bundle.sh env)"   # exports for vllm serve / bench
# Everything lives under /tmp, which the device keeps between calls while the machine is warm.
# vLLM runs on the image's torch 2.11 unless the torch group (torch 2.13, triton 3.7.1) was
# collected: it is, only if check fails on the image's torch (bundle.py TORCH_STACK).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
MANIFEST=$(realpath "${VLLM_MANIFEST:-benchmarks/gpu/bundle_manifest.txt}")
BUNDLE=${VLLM_BUNDLE_DIR:-.bundle}         # where this call's carried part lies (.bundle/cNN)
PARTS=${VLLM_PARTS:-/tmp/vllm_parts}       # parts gathered over the calls
WHEELS=${VLLM_WHEELS:-/tmp/vllm_wheels}    # the reassembled tars, unpacked
SITE=${VLLM_SITE:-/tmp/vllm_site}          # pip --target: goes first on PYTHONPATH
MARKER=${VLLM_MARKER:-/tmp/vllm_bundle.marker}
PY=${PYTHON:-python3}                      # the image's python (torch 2.11, nvidia-* wheels)
SESSION_ENV=${SESSION_ENV:-/tmp/chunkattn_session.env}   # run_on_device.sh's knobs for the session
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
group_complete() {
  local name; while read -r name _; do [ -f "$PARTS/$name" ] || return 1; done < <(parts_of "$1")
}
has_group() { awk -v g="$1" '$1 == "group" && $2 == g {f = 1} END {exit !f}' "$MANIFEST"; }
torch_carried() { has_group torch && group_complete torch; }   # else: the image's torch
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

collect() {   # copy the part(s) carried in this call to $PARTS and verify them at once
  mkdir -p "$PARTS"
  if [ -f "$MARKER" ]; then log "marker found: warm machine, $(wc -l < "$MARKER") earlier call(s)"
  else log "no marker: fresh machine (or the first call)"; fi
  echo "$(date +%T) $(echo "$BUNDLE"/c*)" >> "$MARKER"
  local f name bytes sha
  for f in "$BUNDLE"/c*/bundle.part*; do
    [ -e "$f" ] || continue
    name=$(basename "$f")
    [ -f "$PARTS/$name.ok" ] && continue     # an earlier call's folder, still in the tree
    read -r bytes sha < <(awk -v n="$name" '$1 == "part" && $3 == n {print $4, $5}' "$MANIFEST")
    cp "$f" "$PARTS/$name"
    if [ "$(sha256sum < "$PARTS/$name" | cut -d' ' -f1)" != "$sha" ]; then
      log "BAD checksum: $name (manifest and carried part differ: rebuild or re-carry)"
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
      torch) echo "(carried only if install's check fails on the image's torch)" ;;
      nccl) echo "(carried only with torch, if install's NCCL check fails with nccl_compat.c)" ;;
      esac)}"
  done < <(awk '$1 == "group" {print $2}' "$MANIFEST")
  bash benchmarks/gpu/detached_bench.sh status   # issue #9's bench, if one runs beside the parts
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
        "(its extensions use torch's stable C ABI: bundle.py TORCH_STACK)"
  else
    assemble torch
    if ! nccl_needed; then log "image NCCL >= $NCCL_MIN: nccl group not needed"
    elif group_complete nccl; then assemble nccl
    else log "nccl group not carried: the image's NCCL $(image_version nvidia-nccl-cu13)" \
             "with nccl_compat.c preloaded"; fi
  fi
  "$PY" benchmarks/gpu/recompress.py inflate "$WHEELS"     # big wheels travel as xz
  log "unpacked in $((SECONDS - t0)) s"
}

nccl_compat() {     # torch 2.13's shim, unless NCCL 2.29 came in the nccl group (a real folder)
  rm -f "$COMPAT"
  if torch_carried && nccl_needed && [ -L "$SITE/nvidia/nccl" ]; then
    local cc; cc=$(c_compiler || true)
    if [ -z "$cc" ]; then log "no C compiler for nccl_compat.c: carry the nccl group"; return 0; fi
    "$cc" -x c -shared -fPIC -O2 -o "$COMPAT" benchmarks/gpu/nccl_compat.c
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
export CHUNKATTN_BUILD_DIR=\${CHUNKATTN_BUILD_DIR:-/tmp/chunkattn_jit} MAX_JOBS=\${MAX_JOBS:-16}
EOF
  if [ -f "$COMPAT" ]; then echo "export LD_PRELOAD=$COMPAT\${LD_PRELOAD:+:\$LD_PRELOAD}"; fi
  # knobs the kernel-test call settled for the session (run_on_device.sh: overlap_fallback)
  if [ -f "$SESSION_ENV" ]; then cat "$SESSION_ENV"; fi
}

check() {
  eval "$(print_env)"
  TORCH_CARRIED=$(torch_carried && echo 1 || echo 0) "$PY" - "$MANIFEST" <<'PY'
import importlib, importlib.metadata as md, os, sys
from packaging.requirements import Requirement
ok = True
import torch
print("torch", torch.__version__, torch.__file__, "CUDA", torch.version.cuda)
cuda = torch.cuda.is_available()
print("torch.cuda.is_available():", cuda, torch.cuda.get_device_name() if cuda else "")
import ctypes
runtime = ctypes.c_int()        # torch.cuda.nccl.version() is the version torch was built with
try:                            # the libnccl.so.2 torch loaded (found by its soname)
    ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(runtime))
except OSError as e:
    print("NCCL: not loaded -", e)
print("NCCL loaded:", runtime.value, "| LD_PRELOAD:", os.environ.get("LD_PRELOAD", "-"))
if cuda:
    print("cudnn", torch.backends.cudnn.version(), "| torch built with NCCL",
          torch.cuda.nccl.version())
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    print("matmul ok:", bool(torch.isfinite(x @ x).all()))
    import tempfile, torch.distributed as dist
    try:                        # a real NCCL communicator of torch 2.13 over the loaded NCCL
        dist.init_process_group("nccl", init_method="file://" + tempfile.mktemp(), rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
        t = torch.full((1024,), 2.0, device="cuda")
        dist.all_reduce(t)
        good = bool((t == 2.0).all())
        dist.destroy_process_group()
        print("NCCL all_reduce (1 rank):", "ok" if good else "WRONG SUM")
        ok &= good
    except Exception as e:  # noqa: BLE001
        print("NCCL all_reduce (1 rank) FAILED -", repr(e)[-800:],
              "\n  -> carry the nccl group's remaining parts (collect), then install again")
        ok = False
import triton, vllm
print("triton", triton.__version__, "| vllm", vllm.__version__, vllm.__file__)
for ext in ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"):
    try:
        importlib.import_module(ext)
        print("loaded", ext)
    except ImportError as e:
        print("cannot load", ext, "-", e)
        ok &= ext != "vllm._C_stable_libtorch"     # 0.32's vllm._C (CUDA) goes by this name
if cuda:
    # vLLM's own CUDA ops on this torch against references: on the image's torch 2.11 they run
    # through torch's stable C ABI only (bundle.py TORCH_STACK); wrong or failing means carry
    # torch 2.13 after all.
    try:
        x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, w, 1e-6)
        ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        good = torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)   # bf16 rounding
        err = (out.float() - ref).abs().max().item()
        print(f"vllm._C rms_norm: {'ok' if good else 'WRONG'} (max |err| {err:.3g})")
        ok &= good
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        q, k, v = (torch.randn(128, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bounds = [(0, 48), (48, 128)]           # two sequences, causal, as a prefill runs them
        cu = torch.tensor([0, 48, 128], device="cuda", dtype=torch.int32)
        fa = get_flash_attn_version(head_size=128) or 2
        o = flash_attn_varlen_func(q, k, v, max_seqlen_q=80, cu_seqlens_q=cu, max_seqlen_k=80,
                                   cu_seqlens_k=cu, causal=True, fa_version=fa)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ref = torch.cat([sdpa(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                              is_causal=True).transpose(0, 1) for a, b in bounds])
        good = torch.allclose(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
        err = (o.float() - ref.float()).abs().max().item()
        print(f"flash-attn {fa} varlen: {'ok' if good else 'WRONG'} (max |err| {err:.3g})")
        ok &= good
    except Exception as e:  # noqa: BLE001
        print("vLLM's CUDA ops FAILED on this torch -", repr(e)[-1500:])
        ok = False
    try:                    # informational: which FlashAttention the FLASH_ATTN backend gets
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        print("platform", type(current_platform).__name__,
              current_platform.get_device_capability(),
              "flash-attn version", get_flash_attn_version(head_size=128))
    except Exception as e:  # noqa: BLE001
        print("flash-attn version: unknown -", repr(e))
    # Our CUDA kernel for this torch, built here (~1 min) rather than inside the CUSTOM server's
    # start, whose call has its own budget (serve_ab.sh); the build is cached by torch version.
    import time
    t = time.time()
    try:
        from vllm_chunkattn.ops.native import kernel_name
        kernel = kernel_name("cuda")
        print(f"chunkattn kernel: {kernel} in {time.time() - t:.0f} s (JIT build cached in "
              f"{os.environ['CHUNKATTN_BUILD_DIR']})")
        ok &= kernel == "native-cuda"
    except Exception as e:  # noqa: BLE001
        print("chunkattn kernel: build FAILED -", str(e)[-3000:])
        ok = False
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
print("vllm.general_plugins:", eps)
ok &= "vllm_chunkattn.plugin:register" in eps
names = [l.split()[1] for l in open(sys.argv[1]) if l.startswith("closure ")]
env = {"extra": ""}
for name in names:      # warn only: a version that fails a pin may still import fine
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        print("MISSING", name); ok = False; continue
    for r in map(Requirement, dist.requires or []):
        if r.marker and not r.marker.evaluate(env):
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            continue    # not on the serve path (the closure decides what must be there)
        if r.specifier and not r.specifier.contains(have, prereleases=True):
            why = (" (the image's CUDA libraries, reused on purpose: bundle.py)"
                   if r.name.startswith(("nvidia-", "cuda-toolkit")) else "")
            print(f"version warning: {name} wants {r.name}{r.specifier}, found {have}{why}")
if cuda or os.environ.get("ALLOW_NO_GPU") == "1":
    print("CHECK", "OK" if ok else "FAILED")
    if not ok and os.environ.get("TORCH_CARRIED") == "0":
        print("  -> on the image's torch: carry the torch group's parts (collect; bundle.py "
              "status marks them), then install again: torch 2.13 and triton 3.7.1 then")
else:
    print("CHECK FAILED: no CUDA device"); ok = False
sys.exit(0 if ok else 1)
PY
}

# The GPU tests that import vLLM skip in run_on_device.sh (the image has none): builder + forward
# with no host sync, and FULL decode graphs replaying each step's tree through the builder.
# All of them must pass here: a skip is a failure.
gputests() {
  bash benchmarks/gpu/detached_bench.sh wait     # the GPU is a detached bench's until it ends
  eval "$(print_env)"
  local files last
  mapfile -t files < <(grep -l -E "mark\.gpu" tests/test_*.py | xargs grep -l 'importorskip("vllm")')
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
  env) print_env ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
