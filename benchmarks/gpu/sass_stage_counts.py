"""What a warp issues per full KV stage of the TPP kernels: sm_90a SASS, counted without a GPU.

    .venv/bin/python benchmarks/gpu/sass_stage_counts.py [--base REV] [--out FILE.md]

Builds csrc/cuda/tpp_kernels_bf16.cu for sm_90a to a cubin (nvcc), disassembles the head-128
kernels (cuobjdump, from triton's bundled CUDA tools when the toolkit has none) and counts the
instructions inside each stage loop (a backward branch's span) that holds the loop's HMMAs: the
partial launch's 64-row loop in 64-token stages (128 HMMA a stage) and in the compact 32-token
ones (64; CHUNKATTN_PARTIAL_STAGE_TOKENS=32), and the compact final launch's (32). A stage
loop holding two paths (the last stage's token mask; the KV loads' 32- or 64-bit addresses)
counts both, so each variant below is compiled with every such branch forced to one path:

  base         REV's csrc, forced as `full, i32` below where its source has those branches (as
               it is before they existed: its loop is then one path)
  full, i64    this tree, a full stage, the KV loads' 64-bit path
  full, i32    this tree, a full stage, the 32-bit path (vLLM's flash layout: the default)

Column `depth`: the longest chain of instructions in the stage, each reading a register or
predicate the one before it wrote (one iteration: values carried from the last stage count as
inputs). A count of dependent instructions, not cycles: a fold of 16 scores into a row's max is
15 in a row, a pairwise one 4, whatever each instruction's latency.

Static counts, not timings: whether fewer instructions make a faster kernel only a GPU says
(the kernel grid's "KV loads' addresses" section times both paths side by side).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# kernel -> (its mangled names, newest first: the stage size and then the fp8-KV flag became
# template arguments, so older revisions have names without them), the HMMAs of its stage loop.
# The 16-bit KV kernels (fp8 flag false).
_NAME = "_ZN9chunkattn{}I13__nv_bfloat16Li128E{}EvNS_9TppParamsE"
KERNELS = {"partial (64 rows)": ((_NAME.format("18tpp_partial_kernel", "Li64ELb0EE"),
                                  _NAME.format("18tpp_partial_kernel", "Li64EE"),
                                  _NAME.format("18tpp_partial_kernel", "E")), 128),
           "partial (compact)": ((_NAME.format("18tpp_partial_kernel", "Li32ELb0EE"),
                                  _NAME.format("18tpp_partial_kernel", "Li32EE")), 64),
           "final (compact)": ((_NAME.format("16tpp_final_kernel", "Li32ELb0EE"),
                                _NAME.format("16tpp_final_kernel", "Li32EE")), 32)}
# (file under csrc, text, replacement) forcing one path; each text must occur exactly once.
FULL_STAGE = ("cuda/tpp_attend_tile.cuh", "if (t_begin + (it + 1) * S::kTokens <= t_end)", "if (true)")
KV_PATH = ("cuda/tpp_attend_tile.cuh", "if (p.kv_offsets_i32) {", "if ({}) {{")
SHOWN = ("HMMA", "LDSM", "MUFU", "FMUL", "FADD", "FFMA", "FMNMX", "FSEL", "IMAD", "LEA", "LDGSTS", "LDG")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        sys.exit("sass_stage_counts: no cuobjdump (CUDA toolkit or triton's bundled tools)")
    return str(tool)


def build(csrc: Path, cubin: Path) -> None:
    subprocess.run(["nvcc", "-O3", "-std=c++20", "--expt-relaxed-constexpr", "-gencode",
                    "arch=compute_90a,code=sm_90a", "-cubin", "-o", str(cubin),
                    str(csrc / "cuda" / "tpp_kernels_bf16.cu")], check=True)


def stage_body(sass: str, hmma: int) -> list[tuple[str, str, str]]:
    """The innermost loop (a backward BRA's span) holding `hmma` HMMAs: (guard, opcode, operands)
    of each instruction, in order."""
    ins = [(int(m.group(1), 16), m.group(2) or "", m.group(3), m.group(4)) for m in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@(!?U?P\w+)\s+)?([A-Z0-9_.]+)([^;]*);", sass)]
    at = {addr: i for i, (addr, _, _, _) in enumerate(ins)}
    loops = []
    for i, (addr, _, op, rest) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in at:
            body = [(g, o, r) for _, g, o, r in ins[at[int(target.group(1), 16)]:i + 1]]
            if sum(o.split(".")[0] == "HMMA" for _, o, _ in body) == hmma:
                loops.append(body)
    if not loops:
        raise SystemExit(f"sass_stage_counts: no loop with {hmma} HMMA")
    return min(loops, key=len)


def opcode_counts(body: list[tuple[str, str, str]]) -> collections.Counter:
    """A stage body's instructions by opcode (HMMA.16816.F32.BF16 counts as HMMA)."""
    return collections.Counter(o.split(".")[0] for _, o, _ in body)


def stage_loop(sass: str, hmma: int) -> collections.Counter:
    """The opcode counts of the innermost loop (a backward BRA's span) holding `hmma` HMMAs."""
    return opcode_counts(stage_body(sass, hmma))


# Opcodes that write no register; SHFL writes a predicate, then its register.
NO_DEST = {"ST", "STS", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "BAR", "BRA", "BSSY", "BSYNC",
           "WARPSYNC", "NOP", "EXIT", "RED", "ATOM", "MEMBAR", "CCTL", "YIELD"}


def _registers(operand: str, width: int) -> list[str]:
    """The registers (R, UR; width consecutive) and predicates (P, UP) an operand names; an
    address `[R2.64+0x10]` reads its base register (two if .64)."""
    if "[" in operand:
        return [f"{kind}{int(n) + k}" for kind, n, wide in re.findall(r"\b(U?R)(\d+)(\.64)?", operand)
                for k in range(2 if wide else 1)]
    m = re.fullmatch(r"[-!|~]*(U?R|U?P)(\d+)(?:\.[A-Z0-9_]+)*\|?", operand.strip())
    if not m:
        return []
    return [f"{m.group(1)}{int(m.group(2)) + k}" for k in range(width if m.group(1).endswith("R") else 1)]


def _widths(op: str) -> list[int]:
    """Registers each operand spans: HMMA.16816 D, A, B, C = 4, 4, 2, 4; LDSM .x2 / .x4 its
    destination; a .WIDE result 2; else 1."""
    base = op.split(".")[0]
    if base == "HMMA":
        return [4, 4, 2, 4]
    if base == "LDSM":
        return [4 if op.endswith(".4") else 2 if op.endswith(".2") else 1]
    return [2] if ".WIDE" in op else []


def dependency_depth(body: list[tuple[str, str, str]]) -> int:
    """The longest chain of instructions in `body`, each reading what an earlier one in the chain
    wrote (registers and predicates; RZ, PT and values from before the body are inputs)."""
    writer_depth: dict[str, int] = {}
    deepest = 0
    for guard, op, rest in body:
        operands = [o.strip() for o in rest.split(",") if o.strip()]
        widths = _widths(op) + [1] * len(operands)
        base = op.split(".")[0]
        n_dest = 0 if base in NO_DEST else 2 if base == "SHFL" else 1
        while n_dest < len(operands) and n_dest > 0 and re.fullmatch(r"U?P\d|PT", operands[n_dest]):
            n_dest += 1                    # a predicate written beside the result (IADD3 R, P0, ...)
        reads = [r for k, o in enumerate(operands[n_dest:], n_dest) for r in _registers(o, widths[k])]
        reads += _registers(guard.lstrip("!"), 1) if guard else []
        depth = 1 + max((writer_depth.get(r, 0) for r in reads), default=0)
        for k, o in enumerate(operands[:n_dest]):
            for r in _registers(o, widths[k]):
                writer_depth[r] = depth
        deepest = max(deepest, depth)
    return deepest


def resources(dump: str, cubin: Path, name: str) -> tuple[int, int]:
    """A kernel's registers and stack bytes (spills) as cuobjdump -res-usage says; -1 if absent."""
    out = subprocess.run([dump, "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    line = re.search(re.escape(name) + r"[^\n]*\n([^\n]*)", out)
    got = [re.search(rf"\b{what}:(\d+)", line.group(1)) if line else None for what in ("REG", "STACK")]
    return tuple(int(m.group(1)) if m else -1 for m in got)


def variant(csrc: Path, edits: list[tuple[str, str, str]], where_present: bool = False) -> None:
    """Applies each edit; where_present: skips one whose text the source does not hold."""
    for path, old, new in edits:
        text = (csrc / path).read_text()
        if where_present and text.count(old) == 0:
            continue
        if text.count(old) != 1:
            raise SystemExit(f"sass_stage_counts: {old!r} occurs {text.count(old)} times in {path}")
        (csrc / path).write_text(text.replace(old, new))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="8ca9feb", help="the revision before the stage's branches")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    dump = cuobjdump()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        i32 = [FULL_STAGE, (KV_PATH[0], KV_PATH[1], KV_PATH[2].format("true"))]
        variants = [("base " + a.base, None, i32),
                    ("full, i64", ROOT / "csrc", [FULL_STAGE, (KV_PATH[0], KV_PATH[1], KV_PATH[2].format("false"))]),
                    ("full, i32", ROOT / "csrc", i32)]
        for label, source, edits in variants:
            csrc = tmp / label.replace(" ", "_").replace(",", "")
            if source is None:
                subprocess.run(f"git -C {ROOT} archive {a.base} csrc | tar -x -C {tmp} && mv {tmp}/csrc {csrc}",
                               shell=True, check=True)
            else:
                shutil.copytree(source, csrc)
            variant(csrc, edits, where_present=source is None)
            cubin = tmp / f"{csrc.name}.cubin"
            build(csrc, cubin)
            listing = subprocess.run([dump, "-sass", str(cubin)], capture_output=True, text=True,
                                     check=True).stdout
            for kernel, (names, hmma) in KERNELS.items():
                name = next((n for n in names if f"Function : {n}\n" in listing), None)
                if name is None:
                    continue                      # a kernel REV did not have
                sass = subprocess.run([dump, "-sass", "-fun", name, str(cubin)], capture_output=True,
                                      text=True, check=True).stdout
                body = stage_body(sass, hmma)
                counts = opcode_counts(body)
                rows.append([kernel, label, str(sum(counts.values())), str(dependency_depth(body)),
                             *(str(counts[o]) for o in SHOWN), str(resources(dump, cubin, name)[0])])
        # The kernel as built holds both KV paths: its registers and stack are the ones that run.
        shutil.copytree(ROOT / "csrc", tmp / "as_built")
        build(tmp / "as_built", tmp / "as_built.cubin")
        built = {k: resources(dump, tmp / "as_built.cubin", names[0]) for k, (names, _) in KERNELS.items()}
    head = ["kernel", "variant", "instructions", "depth", *SHOWN, "registers"]
    lines = [f"# Instructions a warp issues per full KV stage (sm_90a SASS, bf16, head 128)", "",
             f"Command: `.venv/bin/python benchmarks/gpu/sass_stage_counts.py --base {a.base}`; "
             f"{subprocess.run(['nvcc', '--version'], capture_output=True, text=True).stdout.strip().splitlines()[-1]}. "
             "Static counts of one stage loop's instructions (benchmarks/gpu/sass_stage_counts.py), "
             "not timings. Depth: the longest chain of instructions a stage each reading what the "
             "one before wrote (dependent instructions, not cycles). Base: REV forced to a full stage "
             "and the 32-bit path where its source has those branches. "
             "Registers: the variant's kernel as compiled with one path; the kernel "
             "as built holds both KV paths (registers / stack bytes as built: "
             + ", ".join(f"{k} {r} / {st}" for k, (r, st) in built.items()) + ").", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             *("| " + " | ".join(r) + " |" for r in rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
