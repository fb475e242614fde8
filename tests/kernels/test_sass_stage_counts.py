"""benchmarks/gpu/sass_stage_counts.py: the paths it forces are the kernel's own text, and a stage
loop is found and counted from SASS as cuobjdump prints it (a hand-made listing)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _body(text):
    return [(g or "", o, r) for g, o, r in re.findall(r"(?:@(!?U?P\w+)\s+)?([A-Z0-9_.]+)([^;]*);", text)]


def test_depth_counts_dependent_instructions_not_instructions():
    # Four values folded into one max: a running fold is 3 in a row after the loads, a pairwise
    # one 2, the same 3 FMNMX either way.
    fold = _body("LDS R0, [R9] ; LDS R1, [R9+0x4] ; LDS R2, [R9+0x8] ; LDS R3, [R9+0xc] ;"
                 "FMNMX R4, R0, R1, !PT ; FMNMX R4, R4, R2, !PT ; FMNMX R4, R4, R3, !PT ;")
    pairs = _body("LDS R0, [R9] ; LDS R1, [R9+0x4] ; LDS R2, [R9+0x8] ; LDS R3, [R9+0xc] ;"
                  "FMNMX R4, R0, R1, !PT ; FMNMX R5, R2, R3, !PT ; FMNMX R4, R4, R5, !PT ;")
    assert tool.dependency_depth(fold) == 4 and tool.dependency_depth(pairs) == 3
    # A value from before the body (R9, R20) is an input, not a link; RZ and PT never are.
    assert tool.dependency_depth(_body("FADD R1, R20, RZ ; FADD R2, R21, RZ ;")) == 1


def test_depth_follows_register_ranges_predicates_and_addresses():
    # HMMA reads A as R8..R11 and writes D as R4..R7; LDSM .4 writes four registers.
    chain = _body("LDSM.16.M88.4 R8, [R2] ; HMMA.16816.F32.BF16 R4, R8, R12, R4 ;"
                  "FMUL R30, R7, 2 ;")
    assert tool.dependency_depth(chain) == 3
    assert tool.dependency_depth(_body("MOV R11, R1 ; HMMA.16816.F32.BF16 R4, R8, R12, RZ ;")) == 2
    assert tool.dependency_depth(_body("MOV R13, R1 ; HMMA.16816.F32.BF16 R4, R8, R12, RZ ;")) == 2
    assert tool.dependency_depth(_body("MOV R14, R1 ; HMMA.16816.F32.BF16 R4, R8, R12, RZ ;")) == 1
    # A predicate written beside a result, then a guard and a select reading it; SHFL's result.
    assert tool.dependency_depth(_body("IADD3 R2, P0, R3, 0x1, RZ ; @P0 MOV R5, R6 ;")) == 2
    assert tool.dependency_depth(_body("FSETP.GT.AND P1, PT, R3, RZ, PT ; FSEL R5, R6, R7, P1 ;")) == 2
    assert tool.dependency_depth(_body("SHFL.BFLY PT, R8, R9, 0x1, 0x1f ; FMNMX R9, R8, R9, !PT ;")) == 2
    # An address reads its base register (a pair if .64); a store writes no register.
    assert tool.dependency_depth(_body("IMAD.WIDE R2, R5, 0x4, R6 ; LDG.E R7, desc[UR4][R3.64] ;")) == 2
    assert tool.dependency_depth(_body("STS [R1], R2 ; MOV R3, R1 ;")) == 1
