"""What nvcc makes of the CUDA kernel's KV stage load (csrc/cuda/tpp_attend_tile.cuh,
load_kv_stage), read from the sm_90a SASS: each thread's block-id loads of a stage issue back to
back, before the stage's copies. Written as one loop (an id, then the copy that needs it), nvcc
13.0 kept every copy waiting on its own id load: 1-2 id loads in a row in every kernel, i.e. one
dependent load latency per token a thread copies, 8 per stage at head 128 (the H100's Nsight
Compute run put the paper point's partial kernel at 52 % of DRAM throughput, its final kernel's
largest stall on long scoreboard). The same over an fp8 cache, whose stages are 8-byte copies.
No GPU needed: nvcc and cuobjdump (Triton's copy will do)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def longest_id_load_runs(sass: str) -> dict[str, int]:
    """kernel -> the most constant-cache global loads (`LDG.E.CONSTANT`, the `__ldg` of block ids)
    issued with no async copy (`LDGSTS`) between them."""
    out = {}
    for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s+Function :|\Z)", sass, re.S):
        run = best = 0
        for ins in re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]*);", body):
            if "LDG.E.CONSTANT" in ins:
                run += 1
                best = max(best, run)
            elif "LDGSTS" in ins:
                run = 0
        out[name] = best
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None or _cuobjdump() is None,
                    reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("fp8", [False, True], ids=["fp16_kv", "fp8_kv"])
def test_a_stages_block_id_loads_issue_together_before_its_copies(tmp_path, fp8):
    import sys

    cubin = tmp_path / "fp16.cubin"
    src = "csrc/cuda/tpp_kernels_fp16_fp8kv.cu" if fp8 else "csrc/cuda/tpp_kernels_fp16.cu"
    r = subprocess.run(["bash", str(ROOT / ".ci" / "compile_cuda.sh"), sys.executable],
                       env={**os.environ, "CUBIN": str(cubin), "CUBIN_SRC": src},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    runs = longest_id_load_runs(sass)
    # A thread copies (stage tokens x head_size / 8 chunks) / 128 threads tokens a stage: each
    # kernel stages 64 tokens at head 64, 96 and 128 by default, 32 at 256, and has a compact
    # 32-token instantiation below 256 (CHUNKATTN_{PARTIAL,FINAL}_STAGE_TOKENS, tpp_params.cuh).
    expect = {(kernel, head, tokens): tokens * head // 8 // 128
              for kernel in ("partial", "final") for head, tokens in
              ((64, 64), (64, 32), (96, 64), (96, 32), (128, 64), (128, 32), (256, 32))}
    got = {}
    for name, best in runs.items():
        m = re.match(r"_ZN9chunkattn\d+tpp_(partial|final)_kernelI6__halfLi(\d+)ELi(\d+)ELb([01])E",
                     name)
        assert m and m.group(4) == str(int(fp8)), name
        got[(m.group(1), int(m.group(2)), int(m.group(3)))] = best
    assert got == expect, got


def test_the_sass_reader_on_lines_as_cuobjdump_writes_them():
    sass = """
\t\tFunction : _ZN9chunkattn18tpp_partial_kernelI6__halfLi128EEEvNS_9TppParamsE
        /*0100*/                   LDG.E.CONSTANT R7, desc[UR8][R6.64] ;   /* 0x000 */
        /*0110*/                   IMAD R9, R7, R8, RZ ;                   /* 0x000 */
        /*0120*/                   LDGSTS.E.BYPASS.128 [R11+0x4700], desc[UR8][R6.64], P1 ;
        /*0130*/              @!P2 LDG.E.CONSTANT R61, desc[UR8][R52.64] ;
        /*0140*/              @!P1 LDG.E.CONSTANT R65, desc[UR8][R54.64] ;
        /*0150*/                   LDG.E R4, desc[UR8][R4.64] ;
        /*0160*/              @!P5 LDG.E.CONSTANT R77, desc[UR8][R54.64] ;
        /*0170*/                   LDGSTS.E.BYPASS.128 [R4+0x8b00], desc[UR8][R62.64], !P2 ;
\t\tFunction : _ZN9chunkattn16tpp_final_kernelI6__halfLi64ELi32EEEvNS_9TppParamsE
        /*0100*/                   LDG.E.CONSTANT R7, desc[UR8][R6.64] ;
"""
    assert longest_id_load_runs(sass) == {
        "_ZN9chunkattn18tpp_partial_kernelI6__halfLi128EEEvNS_9TppParamsE": 3,
        "_ZN9chunkattn16tpp_final_kernelI6__halfLi64ELi32EEEvNS_9TppParamsE": 1}
