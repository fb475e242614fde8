"""What a warp issues per full KV stage of the TPP kernels: sm_90a SASS, counted without a GPU.

    .venv/bin/python benchmarks/gpu/sass_stage_counts.py [--base REV] [--out FILE.md]

Builds csrc/cuda/tpp_kernels_bf16.cu for sm_90a to a cubin (nvcc), disassembles the head-128
kernels (cuobjdump, from triton's bundled CUDA tools when the toolkit has none) and counts the
instructions inside each stage loop (a backward branch's span) that holds the loop's HMMAs: the
partial launch's 64-row loop (128 HMMA a stage) and the compact final launch's (32). A stage
loop holding two paths (the last stage's token mask; the KV loads' 32- or 64-bit addresses)
counts both, so each variant below is compiled with every such branch forced to one path:

  base         REV's csrc as it is (before the branches existed, its loop is one path)
  full, i64    this tree, a full stage, the KV loads' 64-bit path
  full, i32    this tree, a full stage, the 32-bit path (vLLM's flash layout: the default)

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
KERNELS = {"partial (64 rows)": ("_ZN9chunkattn18tpp_partial_kernelI13__nv_bfloat16Li128EEEvNS_9TppParamsE", 128),
           "final (compact)": ("_ZN9chunkattn16tpp_final_kernelI13__nv_bfloat16Li128ELi32EEEvNS_9TppParamsE", 32)}
# (file under csrc, text, replacement) forcing one path; each text must occur exactly once.
FULL_STAGE = ("cuda/tpp_attend_tile.cuh", "if (t_begin + (it + 1) * S::kTokens <= t_end)", "if (true)")
KV_PATH = ("cuda/tpp_attend_tile.cuh", "if (p.kv_offsets_i32) {", "if ({}) {{")
SHOWN = ("HMMA", "LDSM", "MUFU", "FMUL", "FADD", "FMNMX", "FSEL", "IMAD", "LEA", "LDGSTS", "LDG")


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
    subprocess.run(["nvcc", "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-gencode",
                    "arch=compute_90a,code=sm_90a", "-cubin", "-o", str(cubin),
                    str(csrc / "cuda" / "tpp_kernels_bf16.cu")], check=True)


def stage_loop(sass: str, hmma: int) -> collections.Counter:
    """The opcode counts of the innermost loop (a backward BRA's span) holding `hmma` HMMAs."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass)]
    at = {addr: i for i, (addr, _, _) in enumerate(ins)}
    loops = []
    for i, (addr, op, rest) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in at:
            body = collections.Counter(o.split(".")[0] for _, o, _ in ins[at[int(target.group(1), 16)]:i + 1])
            if body["HMMA"] == hmma:
                loops.append(body)
    if not loops:
        raise SystemExit(f"sass_stage_counts: no loop with {hmma} HMMA")
    return min(loops, key=lambda c: sum(c.values()))


def resources(dump: str, cubin: Path, name: str) -> tuple[int, int]:
    """A kernel's registers and stack bytes (spills) as cuobjdump -res-usage says; -1 if absent."""
    out = subprocess.run([dump, "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    line = re.search(re.escape(name) + r"[^\n]*\n([^\n]*)", out)
    got = [re.search(rf"\b{what}:(\d+)", line.group(1)) if line else None for what in ("REG", "STACK")]
    return tuple(int(m.group(1)) if m else -1 for m in got)


def variant(csrc: Path, edits: list[tuple[str, str, str]]) -> None:
    for path, old, new in edits:
        text = (csrc / path).read_text()
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
        variants = [("base " + a.base, None, []),
                    ("full, i64", ROOT / "csrc", [FULL_STAGE, (KV_PATH[0], KV_PATH[1], KV_PATH[2].format("false"))]),
                    ("full, i32", ROOT / "csrc", [FULL_STAGE, (KV_PATH[0], KV_PATH[1], KV_PATH[2].format("true"))])]
        for label, source, edits in variants:
            csrc = tmp / label.replace(" ", "_").replace(",", "")
            if source is None:
                subprocess.run(f"git -C {ROOT} archive {a.base} csrc | tar -x -C {tmp} && mv {tmp}/csrc {csrc}",
                               shell=True, check=True)
            else:
                shutil.copytree(source, csrc)
            variant(csrc, edits)
            cubin = tmp / f"{csrc.name}.cubin"
            build(csrc, cubin)
            for kernel, (name, hmma) in KERNELS.items():
                sass = subprocess.run([dump, "-sass", "-fun", name, str(cubin)], capture_output=True,
                                      text=True, check=True).stdout
                counts = stage_loop(sass, hmma)
                rows.append([kernel, label, str(sum(counts.values())), *(str(counts[o]) for o in SHOWN),
                             str(resources(dump, cubin, name)[0])])
        # The kernel as built holds both KV paths: its registers and stack are the ones that run.
        shutil.copytree(ROOT / "csrc", tmp / "as_built")
        build(tmp / "as_built", tmp / "as_built.cubin")
        built = {k: resources(dump, tmp / "as_built.cubin", n) for k, (n, _) in KERNELS.items()}
    head = ["kernel", "variant", "instructions", *SHOWN, "registers"]
    lines = [f"# Instructions a warp issues per full KV stage (sm_90a SASS, bf16, head 128)", "",
             f"Command: `.venv/bin/python benchmarks/gpu/sass_stage_counts.py --base {a.base}`; "
             f"{subprocess.run(['nvcc', '--version'], capture_output=True, text=True).stdout.strip().splitlines()[-1]}. "
             "Static counts of one stage loop's instructions (benchmarks/gpu/sass_stage_counts.py), "
             "not timings. Registers: the variant's kernel as compiled with one path; the kernel "
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
