#!/usr/bin/env bash
# Fetch vLLM's own sources (tests/ and the Python package, no build) at one version from its
# source distribution on the package registry, into .cache/vllm-src/VERSION (git-ignored).
# vLLM's tests are never copied into this repo; tests/external/test_vllm_external.py runs them from here.
#
#   bash tests/external/fetch_vllm_tests.sh [VERSION]     # default 0.32.0; cached after the first run
#
# pip cannot prepare vLLM's metadata without its CUDA build tool chain, but with --no-clean it
# leaves the unpacked sdist in its temporary folder, which is all we need (TMPDIR says where).
set -euo pipefail
version=${1:-0.32.0}
root=$(cd "$(dirname "$0")/../.." && pwd)
dest="$root/.cache/vllm-src/$version"
[ -f "$dest/.complete" ] && { echo "vLLM $version sources cached in $dest"; exit 0; }

if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=${PY:-python3}; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
TMPDIR="$work" "$py" -m pip download -q --retries 2 --timeout 20 --no-deps --no-binary :all: \
    --no-build-isolation --no-clean "vllm==$version" -d "$work/dl" >"$work/pip.log" 2>&1 || true
src=$(ls -d "$work"/pip-*/vllm_*/ 2>/dev/null | head -n1 || true)
if [ -z "$src" ] || [ ! -f "$src/PKG-INFO" ] || [ ! -d "$src/tests/v1/core" ]; then
    tail -n 20 "$work/pip.log" >&2
    echo "could not fetch the vLLM $version source distribution" >&2
    exit 1
fi
grep -qx "Version: $version" "$src/PKG-INFO" || { echo "sdist is not vLLM $version" >&2; exit 1; }

rm -rf "$dest" && mkdir -p "$dest"
cp -r "$src/tests" "$dest/tests"
# The Python package's sources, read by the signature checks: kept out of the tests' import
# path (pkg/, not next to tests/), where they would shadow the installed vLLM.
mkdir -p "$dest/pkg"
(cd "$src" && find vllm -name '*.py' -print0 | tar -cf - --null -T -) | tar -xf - -C "$dest/pkg"
cp "$src/PKG-INFO" "$dest/"
touch "$dest/.complete"
echo "vLLM $version sources fetched into $dest"
