"""benchmarks/gpu/sass_stage_counts.py: the paths it forces are the kernel's own text, and a stage
loop is found and counted from SASS as cuobjdump prints it (a hand-made listing)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sass_stage_counts",
                                              ROOT / "benchmarks" / "gpu" / "sass_stage_counts.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

LISTING = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0120*/                   IMAD.WIDE.U32 R2, R3, 0x4, R6 ;
        /*0130*/              @!P0 BRA 0x110 ;
        /*0140*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0150*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0160*/                   HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*0170*/              @P1 FMUL R5, R5, 0.5 ;
        /*0180*/                   MUFU.EX2 R5, R5 ;
        /*0190*/               @P2 BRA 0x140 ;
        /*01a0*/                   EXIT ;
"""


def test_the_forced_paths_are_the_kernels_text():
    for path, old, _ in (tool.FULL_STAGE, tool.KV_PATH):
        assert (ROOT / "csrc" / path).read_text().count(old) == 1, old


def test_the_stage_loop_is_the_backward_branchs_span_with_its_hmmas():
    loop = tool.stage_loop(LISTING, 2)            # 0x140..0x190: the second loop
    assert loop["HMMA"] == 2 and loop["LDSM"] == 1 and loop["FMUL"] == 1 and loop["MUFU"] == 1
    assert sum(loop.values()) == 6
    assert sum(tool.stage_loop(LISTING, 1).values()) == 3      # 0x110..0x130
    with pytest.raises(SystemExit):
        tool.stage_loop(LISTING, 3)
