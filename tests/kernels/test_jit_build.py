"""The JIT build's cache (vllm_chunkattn/ops/jit_build.py) survives the checkout moving: the same
sources built from another directory reuse the library instead of compiling again. torch writes
absolute paths into build.ninja, so before the sources were staged inside the build dir every
move rebuilt (on the device: the detached benchmark's snapshot of the tree, a minute of nvcc)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import SIMT_CSRC

ROOT = Path(__file__).resolve().parents[2]


def test_a_moved_checkout_reuses_the_built_library(emu, tmp_path):
    from vllm_chunkattn.ops.jit_build import build_dir

    out = build_dir(SIMT_CSRC, "simt-emulation")
    built = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.suffix in {".so", ".o"}}
    assert any(p.suffix == ".so" for p in built), sorted(out.iterdir())

    moved = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(SIMT_CSRC, moved)
    assert build_dir(moved, "simt-emulation") == out          # same content, same key
    code = ("import sys, torch; from vllm_chunkattn.ops.jit_build import load_simt_emulation;"
            "load_simt_emulation(sys.argv[1]); print(torch.ops.chunkattn_simt.partial_smem_bytes(128))")
    r = subprocess.run([sys.executable, "-c", code, str(moved)], cwd=tmp_path, text=True,
                       capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) == emu.partial_smem_bytes(128)
    after = {p: p.stat().st_mtime_ns for p in built}
    assert after == built, "the moved checkout compiled again"
