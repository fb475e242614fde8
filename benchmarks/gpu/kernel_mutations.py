"""Do tests/kernels/test_cuda_host.py and the SIMT emulation tests
(tests/kernels/test_cuda_*_emulation.py) catch a broken CUDA kernel? Each mutation below is a bug of a kind that kernel work makes (a
fragment layout, a missing wait or barrier, a mask, the smem size, the grid dependency of the
overlapped final launch, the work decomposition and its KV splits, on the host and in a padded
plan's CTAs, an fp8 cache's staging, conversion and scales);
each is applied to a copy of csrc/, and those tests run against that copy (-x: stop at the first
failure). A mutation the tests do not catch is printed as MISSED and the exit status is 1.

    .venv/bin/python benchmarks/gpu/kernel_mutations.py        # ~60 min on 2 cores (54 mutations)
    .venv/bin/python benchmarks/gpu/kernel_mutations.py KV     # those whose names say "KV"
    .venv/bin/python benchmarks/gpu/kernel_mutations.py fp8    # the fp8 cache's
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The kernel's source is cuda/tpp_kernels.cuh and the headers it includes; a mutation names its text,
# found in exactly one of them.
KERNEL = ("cuda/tpp_params.cuh", "cuda/tpp_attend_tile.cuh", "cuda/tpp_scores.cuh",
          "cuda/tpp_slot_merge.cuh", "cuda/tpp_kernels.cuh")
HOST = "cuda/tpp_host.h"
TESTS = ["tests/kernels/test_cuda_host.py", "tests/kernels/test_cuda_fp8_emulation.py",
         "tests/kernels/test_cuda_variants_emulation.py",
         "tests/kernels/test_cuda_simt_emulation.py"]   # host first: seconds

# (name, text in one of KERNEL's files, its replacement); each text occurs exactly once in them.
MUTATIONS = [
    ("K fragment: rows of the wrong ldmatrix matrices",
     "((lane / 8) % 2) * 8);", "(lane / 16) * 8);"),
    ("V read without .trans",
     "ldmatrix_x4_trans(b, sv", "ldmatrix_x4(b, sv"),
    ("no cp.async.wait_group before the stage is read",
     "    cp_async_wait<1>();\n", ""),
    ("no __syncthreads before the next prefetch overwrites a stage",
     "    __syncthreads();  // the stage is overwritten by the next iteration's prefetch", ""),
    ("P fragment registers swapped",
     "pack2<T>(s[2 * ks][2], s[2 * ks][3]),\n                          pack2<T>(s[2 * ks + 1][0], s[2 * ks + 1][1]),",
     "pack2<T>(s[2 * ks + 1][0], s[2 * ks + 1][1]),\n                          pack2<T>(s[2 * ks][2], s[2 * ks][3]),"),
    ("dynamic smem 32 bytes short",
     "max_rows * kLd * 2 + kKvBytes;", "max_rows * kLd * 2 + kKvBytes - 32;"),
    ("no __syncthreads after the row metadata is written",
     "  __syncthreads();\n  const int b0 = p.node_block_indptr[n];", "  const int b0 = p.node_block_indptr[n];"),
    ("final merge skips the last tail split",
     "total = chunk_slots + p.seq_splits - 1;", "total = chunk_slots + p.seq_splits - 2;"),
    ("every KV part's warp of a final CTA merges every slot",
     "j < n; j += num_parts)", "j < n; j += 1)"),
    ("the slot list is read before every thread has written it",
     "base, n, list);\n      __syncthreads();", "base, n, list);"),
    ("the next batch of the slot list is written while the last one is merged",
     "      if (base > 0) __syncthreads();  // the last batch is merged\n", ""),
    ("a final CTA merges the first batch of its slots only",
     "base == 0 || base < total;", "base == 0;"),
    ("one row block for up to 32 rows",
     "if (num_rows <= 16)", "if (num_rows <= 32)"),
    ("window search ignores the node index",
     "if (ind[mid] / p.chunk_seqs + mid <= win) lo = mid;", "if (ind[mid] / p.chunk_seqs <= win) lo = mid;"),
    ("row max over pairs of lanes, not the quad",
     "        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));\n", ""),
    ("no __syncthreads before the KV parts are merged",
     "    __syncthreads();\n    if (part == 0) {", "    if (part == 0) {"),
    ("token mask off by one",
     "if (tok0 + nb * 8 + (e & 1) >= t_end) s[nb][e] = -INFINITY;",
     "if (tok0 + nb * 8 + (e & 1) > t_end) s[nb][e] = -INFINITY;"),
    ("a row's max over every other score",
     "for (int w = 1; w < N; w *= 2)", "for (int w = 2; w < N; w *= 2)"),
    ("the scale left out of a row's max",
     "fmaxf(m2[r], mx[r] * p.scale_log2)", "fmaxf(m2[r], mx[r])"),
    ("the row sum left unrescaled by the new max",
     "l[r] = fmaf(l[r], alpha[r], tree_reduce(", "l[r] = fmaf(l[r], 1.f, tree_reduce("),
    ("a run's last stage taken for a full one: its tokens past the run unmasked",
     "if (t_begin + (it + 1) * S::kTokens <= t_end)", "if (t_begin + it * S::kTokens < t_end)"),
    ("the final kernel merges the partial slots without waiting for the partial grid",
     "if (base == 0) wait_for_primary_grid();", ""),
    ("the wave rule takes the most splits, not the fewest",
     "for (int s = 1; s <= q.max_splits; ++s)\n    if (is_enough",
     "for (int s = q.max_splits; s >= 1; --s)\n    if (is_enough"),
    ("a padded plan's CTAs take the most splits",
     "return first < 32 ? first + 1 : 1;", "return q.max_splits;"),
    ("a padded plan's CTAs keep the host's one split",
     "  if (!p.device_splits) return {", "  if (true) return {"),
    ("a padded plan's chunk CTAs run one item each, not every item of the tree",
     "x < items; x += p.chunk_ctas)", "x < items && x == int(blockIdx.x); x += p.chunk_ctas)"),
    ("no __syncthreads between a chunk CTA's items",
     "      if (x != int(blockIdx.x)) __syncthreads();", ""),
    ("the final merge counts the host's splits, not the launch's",
     "(k1 - k0) * cs.splits", "(k1 - k0) * p.chunk_splits"),
    ("the final launch never picks the compact (default) final kernel",
     "return with_stage<D>(p.final_stage_tokens, f);", "return with_stage<D>(0, f);"),
    ("the partial launch never picks its compact kernel",
     "return with_stage<D>(p.partial_stage_tokens, f);", "return with_stage<D>(0, f);"),
    ("the compact partial kernel's 64-row chunk CTAs stream in the default stage's smem layout",
     "attend_tile<T, D, 4, false, TOKENS, FP8>(", "attend_tile<T, D, 4, false, TileShape<D>::kTokens, FP8>("),
    ("the compact final kernel streams in the default stage's smem layout",
     "attend_tile<T, D, 1, true, TOKENS, FP8>(", "attend_tile<T, D, 1, true, TileShape<D>::kTokens, FP8>("),
    ("a KV copy uses the next token's block id",
     "rows(blk[i], t & mask)", "rows(blk[(i + 1) % kPerThread], t & mask)"),
    ("a stage's tokens past the run are copied, not zero-filled",
     "const int bytes = t < t_end ? kCopyBytes : 0;", "const int bytes = kCopyBytes;"),
    ("the 32-bit KV path reads V at K's address",
     "reinterpret_cast<uintptr_t>(k) + v_minus_k", "reinterpret_cast<uintptr_t>(k)"),
    ("the 32-bit KV path reads every token of a block at its first row",
     "key_head + (block * k_block + row * k_tok)", "key_head + (block * k_block)"),
    ("the 64-bit KV path reads V with K's strides",
     "value_head + block * p.v_stride_block + int64_t(row) * p.v_stride_tok",
     "value_head + block * p.k_stride_block + int64_t(row) * p.k_stride_tok"),
    ("head 96: every copy of a thread in its first chunk",
     ": (x + i * kThreads) % kChunks; }", ": 0; }"),
    ("sliding window: a chunk item's rows see the node before their edges",
     "if (t_begin + it * S::kTokens < lo_hi) mask_window", "if (false) mask_window"),
    ("sliding window: a chunk item loads the KV before its rows' lowest edge",
     "    t_begin = max(t_begin, lo_lo);\n", ""),
    ("sliding window: a tail starts at its first token, not its edge",
     "  const int lo = window_edge(p, seq, first);", "  const int lo = 0;"),
    ("soft cap after the mask (a masked score becomes -cap)",
     "      if (p.soft_cap_log2 > 0.f) soft_cap_scores<kTokW / 8>(s, p.soft_cap_log2, p.soft_cap_in);\n"
     "      const int tok0 = t_begin + it * S::kTokens + part * kTokW + 2 * (lane % 4);\n"
     "      if (t_begin + it * S::kTokens < lo_hi) mask_window<kTokW / 8>(s, tok0, lo);\n",
     "      const int tok0 = t_begin + it * S::kTokens + part * kTokW + 2 * (lane % 4);\n"
     "      if (t_begin + it * S::kTokens < lo_hi) mask_window<kTokW / 8>(s, tok0, lo);\n"
     "      if (p.soft_cap_log2 > 0.f) soft_cap_scores<kTokW / 8>(s, p.soft_cap_log2, p.soft_cap_in);\n"),
    ("sinks: o not rescaled to the sink's max",
     "const float inv = a * p.v_scale /", "const float inv = p.v_scale /"),
    ("fp8: v_scale left out of the output",
     "const float inv = a * p.v_scale /", "const float inv = a /"),
    ("fp8: a stage converted before its copies landed",
     "    cp_async_wait<1>();\n    if constexpr (FP8) {",
     "    if constexpr (FP8) {\n      cp_async_wait<2>();"),
    ("fp8: every stage converted from the first stage's bytes",
     "const uint8_t* raw = stage_kv(it % S::kStages);", "const uint8_t* raw = stage_kv(0);"),
    ("fp8: a thread converts the chunks another warp's thread copied",
     "  const C chunks{int(threadIdx.x)};\n  const int c = chunks.first_chunk();\n#pragma unroll",
     "  const C chunks{int(threadIdx.x + 32) % kThreads};\n  const int c = chunks.first_chunk();\n"
     "#pragma unroll"),
    ("fp8: e5m2 read as e4m3",
     "if (p.kv_fp8 == kKvE5m2)", "if (p.kv_fp8 != kKvE5m2)"),
    ("fp8: the MMAs read the tile of the stage the bytes landed in",
     "(FP8 ? 0 : it % S::kStages)", "(it % S::kStages)"),
]
# The same, in csrc/cuda/tpp_host.h.
HOST_MUTATIONS = [
    ("window grid without a window per node",
     "num_nodes + ceil_div(num_partials, w.chunk_seqs)", "ceil_div(num_partials, w.chunk_seqs)"),
    ("splits not lowered to the workspace's rows",
     "if (ss > 1) --ss;\n    else --cs;", "break;"),
    ("a padded plan's grid never loops, whatever its capacities",
     "> kLoopWaves * resident ?", "> 1000 * kLoopWaves * resident ?"),
    ("fp8: k_scale left out of the scores",
     "const double qk_scale = fp8 ? a.scale * a.k_scale : a.scale;", "const double qk_scale = a.scale;"),
    ("the 32-bit KV path whatever V's strides",
     "p.kv_offsets_i32 = kv_offsets_fit_i32(key_cache, value_cache) &&", "p.kv_offsets_i32 = true &&"),
]


def run_one(name: str, path: str, old: str, new: str, work: Path) -> tuple[bool, str, float]:
    csrc = work / "csrc"
    shutil.rmtree(csrc, ignore_errors=True)
    shutil.copytree(ROOT / "csrc", csrc)
    source = csrc / path
    text = source.read_text()
    assert text.count(old) == 1, f"{name}: the mutated text occurs {text.count(old)} times"
    source.write_text(text.replace(old, new))
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "CHUNKATTN_SIMT_CSRC": str(csrc)})
    failed = re.search(r"^FAILED (\S+)", proc.stdout, re.M)
    # A crash (an emulated store past the workspace, say) fails the run as surely as an assert.
    crashed = re.search(r"Fatal Python error: (\w+)", proc.stdout + proc.stderr)
    by = (failed.group(1).split("::")[-1] if failed
          else f"a crash ({crashed.group(1) if crashed else f'exit {proc.returncode}'})")
    return proc.returncode != 0, by, time.time() - t0


def _holder(text: str) -> str:
    """The one kernel file that holds a mutation's text."""
    holders = [f for f in KERNEL if text in (ROOT / "csrc" / f).read_text()]
    assert len(holders) == 1, f"{text!r} is in {holders or 'none'} of {KERNEL}"
    return holders[0]


def main(argv: list[str]) -> int:
    missed = 0
    every = [(_holder(m[1]), *m) for m in MUTATIONS] + [(HOST, *m) for m in HOST_MUTATIONS]
    # Words after the command keep only the mutations whose names hold one of them ("KV", say).
    every = [m for m in every if not argv or any(w in m[1] for w in argv)]
    print("| mutation | caught by | seconds |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for path, name, old, new in every:
            caught, test, secs = run_one(name, path, old, new, Path(tmp))
            missed += not caught
            print(f"| {name} | {test if caught else 'MISSED'} | {secs:.0f} |", flush=True)
    print(f"\n{len(every) - missed} of {len(every)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
