// The TPP CUDA kernels' contract with their launch: the tile shapes (and from them each
// launch's shared memory), the one dispatch over the instantiated dtypes and head sizes, and
// TppParams, everything a launch reads. Included by the kernels (tpp_kernels.cuh), the op's host
// code (tpp_host.h, through them) and, under CHUNKATTN_SIMT_EMULATION, the CPU emulation.
#pragma once

#ifdef CHUNKATTN_SIMT_EMULATION
#include "../cuda_emu/simt_emu.h"  // tests only: CPU fibers stand in for CUDA threads
#else
#include <cuda_runtime.h>

#include "tpp_ptx.cuh"
#endif
#include <stdint.h>

#include <type_traits>

#include "../tpp_plan_arrays.h"

namespace chunkattn {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRows = 16 * kWarps;  // rows of a chunk CTA: sharers x q heads of a kv group
constexpr int kSeqHeads = 16;          // q heads of a sequence-first CTA: one m16 row block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr int default_stage_tokens(int head_size) { return head_size <= 128 ? 64 : 32; }

// TOKENS: KV tokens per smem stage; the tails' split boundaries (tail_range) and the chunk
// splits' always use the default, either launch may stage in kCompactStageTokens.
template <int D, int TOKENS = default_stage_tokens(D)>
struct TileShape {
  static constexpr int kTokens = TOKENS;
  static constexpr int kLd = D + 8;       // padded smem row: 8 ldmatrix rows hit distinct banks
  static constexpr int kStages = 2;       // cp.async double buffering
  static constexpr int kMaxParts = kTokens / 16;  // a KV part needs >= 16 tokens (one PV k-step)
  static constexpr int kMetaBytes = kMaxRows * (8 + 4 + 4);  // Smem's row_q, row_out, row_lo
  static constexpr int kKvBytes = kStages * 2 * kTokens * kLd * 2;
  static constexpr int kRedBytes = (kWarps - 1) * 16 * (D + 2) * 4;
  static_assert(kRedBytes <= kKvBytes, "KV-part merge buffer aliases the KV stages");
  // A final CTA's list of the slots it merges, after the merge buffer in the idle KV stages
  // (tpp_slot_merge.cuh, list_row_slots): this many at a time.
  static constexpr int kSlotListCap = (kKvBytes - kRedBytes) / 4;
  // An fp8 cache's stages land as bytes (kStages x (K + V) x kTokens x kLd) in the second half
  // of the KV region; each is converted into the first stage's tile, which the MMAs read: the
  // same smem as a 16-bit cache.
  static constexpr int kRawOffset = kKvBytes / 2;
  static_assert(kStages * 2 * kTokens * kLd <= kKvBytes - kRawOffset, "fp8 stages fit");
  static constexpr int smem_bytes(int max_rows) {
    return ((kMetaBytes + 15) / 16) * 16 + max_rows * kLd * 2 + kKvBytes;
  }
};

// Dynamic shared memory of the partial kernel (the larger launch) for a head size, in its
// default stage (the compact one needs less). Head 256 needs 102400 bytes, over the 99 KB
// (101376) a block gets on sm_86/89/120 (A10, L4, RTX 30-50): vllm_chunkattn/ops/cuda_fit.py
// refuses that pairing when vLLM selects the backend.
constexpr int tpp_partial_smem_bytes(int head_size) {
  return head_size == 64    ? TileShape<64>::smem_bytes(kMaxRows)
         : head_size == 96  ? TileShape<96>::smem_bytes(kMaxRows)
         : head_size == 128 ? TileShape<128>::smem_bytes(kMaxRows)
                            : TileShape<256>::smem_bytes(kMaxRows);
}

// The final launch's compact stage (the default; CHUNKATTN_FINAL_STAGE_TOKENS=64 keeps the
// partial launch's stage, tpp_host.h): half the partial launch's 64 tokens at head <= 128, so
// its smem (40 KB at head 128, from 73 KB) and 128 registers (final_min_ctas,
// tpp_final_kernel's __launch_bounds__) let 4 CTAs share an SM, not 3. Why: the final launch
// is 1024 CTAs of one q head at the paper's 32 x 32 heads, 2.6 waves of 396 on an H100, a third
// of the decode with everything shared and all of it with nothing shared (Nsight Compute); at
// 4 an SM they are 1.94 waves. Only half the CTA's warps then split a stage (kMaxParts = 2).
// Head 256 already stages 32 tokens: the same kernel either way.
constexpr int kCompactStageTokens = 32;
constexpr int final_min_ctas(int head_size, int tokens) {
  return tokens < default_stage_tokens(head_size) ? 4 : 2;
}

// The partial launch's compact stage (CHUNKATTN_PARTIAL_STAGE_TOKENS=32; not the default until
// a GPU has timed it beside the 64-token stage: the kernel grid's "Partial launch's KV stage").
// Why: at head 128 the 64-token partial kernel holds 86 KB of smem and 226-242 registers, so 2
// CTAs (8 warps) share an SM; the H200's Nsight Compute put the served shape's chunk-first
// launch at 12 % occupancy, 40 % of issue slots busy, its warps stalled first on fixed-latency
// dependencies (ncu_h200.md): too few warps to hide a warp's softmax between its two GEMMs. In
// 32-token stages it needs 53 KB and fits 168 registers without spilling (ptxas, sm_90a; the
// 64-token kernel also fits them, but not 3 CTAs' smem), so 3 CTAs (12 warps) share an SM, at
// the price of twice the stage barriers and rescales a token, half the tokens in flight a CTA,
// and half the warps of a <= 16-row CTA splitting a stage (kMaxParts = 2). Head 256 already
// stages 32 tokens.
constexpr int partial_min_ctas(int head_size, int tokens) {
  return tokens < default_stage_tokens(head_size) ? 3 : 2;
}

// The KV cache's element type: the query's 16-bit type, or fp8 (which one: TppParams::kv_fp8),
// dequantized to it as each stage lands in smem.
enum KvFp8 : int { kKvNotFp8 = 0, kKvE4m3 = 1, kKvE5m2 = 2 };

// The one dispatch over the kernel's instantiations (fp16 / bf16 queries x 16-bit / fp8 KV x
// head 64 / 96 / 128 / 256; the op checked the head size): calls
// f(DtypeTag<T>{}, std::bool_constant<FP8>{}, std::integral_constant<int, D>{}).
template <typename T>
struct DtypeTag {
  using type = T;
};
template <typename F>
decltype(auto) with_tpp_types(bool half, bool fp8_kv, int head_size, F&& f) {
  const auto with_dtypes = [&](auto d) -> decltype(auto) {
    using H = DtypeTag<__half>;
    using B = DtypeTag<__nv_bfloat16>;
    if (fp8_kv) return half ? f(H{}, std::true_type{}, d) : f(B{}, std::true_type{}, d);
    return half ? f(H{}, std::false_type{}, d) : f(B{}, std::false_type{}, d);
  };
  if (head_size == 64) return with_dtypes(std::integral_constant<int, 64>{});
  if (head_size == 96) return with_dtypes(std::integral_constant<int, 96>{});
  if (head_size == 128) return with_dtypes(std::integral_constant<int, 128>{});
  return with_dtypes(std::integral_constant<int, 256>{});
}

// ---- Chunk-first KV splits: one rule, run by the host on an exact plan's shapes
// (tpp_host.h) and, for a plan padded to a CUDA graph's capacities, by every CTA on the plan's
// real counts (chunk_splits_of below), since a captured launch cannot ask the host again.

// Fraction of the CTA slots a launch of `ctas` keeps busy over its waves (`resident` CTAs run at
// once): 1.09 waves leave the last 0.09 wave nearly alone on the GPU for much of a full wave's
// time, since one CTA streams its KV at a fraction of the HBM bandwidth (a model, not measured).
__host__ __device__ inline double wave_fill(int64_t ctas, int64_t resident) {
  if (ctas <= 0) return 0.0;
  const int64_t waves = (ctas + resident - 1) / resident;
  return double(ctas) / double(waves * resident);
}

// A split choice's inputs: `per_split` CTAs per split beside `fixed` CTAs of the same launch,
// at most `max_splits`, `resident` CTAs at once.
struct SplitQuery {
  int64_t per_split, fixed;
  int max_splits;
  int64_t resident;
};

// KV splits: none once a launch is 0.8 wave (or there is nothing to split); else the fewest in
// [1, max_splits] that fill the waves within 85 % of the best count (flash-decoding's rule:
// fewer splits, fewer partial states to merge). split_needed and is_enough are the rule; the
// host runs it as a loop (splits_filling_waves), a padded plan's CTAs one split per lane.
__host__ __device__ inline bool split_needed(const SplitQuery& q) {
  return q.per_split > 0 && q.max_splits > 1 && 10 * (q.per_split + q.fixed) < 8 * q.resident;
}
__host__ __device__ inline double fill_with(const SplitQuery& q, int splits) {
  return wave_fill(q.fixed + splits * q.per_split, q.resident);
}
__host__ __device__ inline bool is_enough(double fill, double best) { return fill >= 0.85 * best; }

inline int splits_filling_waves(const SplitQuery& q) {
  if (!split_needed(q)) return 1;
  double best = 0.0;
  for (int s = 1; s <= q.max_splits; ++s) {
    const double fill = fill_with(q, s);
    best = fill > best ? fill : best;
  }
  for (int s = 1; s <= q.max_splits; ++s)
    if (is_enough(fill_with(q, s), best)) return s;
  return 1;
}

constexpr int kMaxChunkSplits = 16;  // <= 32: a lane each in splits_filling_waves_warp

// Splits of the shared nodes' KV: none under ~256 tokens a CTA, at most kMaxChunkSplits, sized to
// the waves. `nodes` hold `node_blocks` blocks and `partials` (node, row) pairs; a window is one
// chunk CTA's rows of a node, `ctas_per_window` its head tiles x kv heads; `fixed`: the launch's
// tail-split CTAs. At least one window per node and one per chunk_seqs partials (exact for the
// usual trees; the grid's other windows exit at once).
__host__ __device__ inline SplitQuery chunk_split_query(int64_t nodes, int64_t partials, int64_t node_blocks,
                                                        int block_size, int chunk_seqs,
                                                        int64_t ctas_per_window, int64_t fixed,
                                                        int64_t resident) {
  if (nodes <= 0) return {0, fixed, 1, resident};  // nothing to split
  const int64_t by_rows = (partials + chunk_seqs - 1) / chunk_seqs;
  const int64_t windows = nodes > by_rows ? nodes : by_rows;
  const int64_t avg_tokens = node_blocks * block_size / nodes;
  const int64_t cap = avg_tokens / 256 < kMaxChunkSplits ? avg_tokens / 256 : kMaxChunkSplits;
  return {windows * ctas_per_window, fixed, int(cap > 1 ? cap : 1), resident};
}

// Everything a launch reads: the plan's arrays (PlanArrays) and what follows. Strides are in
// elements; the last dim of every tensor is dense.
struct TppParams : PlanArrays {
  const void* query;
  int64_t q_stride_seq, q_stride_head;
  const void* key;
  int64_t k_stride_block, k_stride_tok, k_stride_head;
  const void* value;
  int64_t v_stride_block, v_stride_tok, v_stride_head;
  float* partial_o;  // [slots, num_heads, D] contiguous
  float* partial_m;  // [slots, num_heads] contiguous
  float* partial_l;
  void* out;
  int64_t out_stride_seq, out_stride_head;
  float* lse;  // nullable
  int64_t lse_stride_seq, lse_stride_head;
  int num_seqs, num_nodes, num_partials, num_heads, num_kv_heads, group;
  int block_size_log2;
  // What a raw score q.k is multiplied by to be a log2-domain logit: softmax scale * log2(e);
  // 1 with a soft cap, whose tanh (soft_cap_log2 * tanh(q.k * soft_cap_in)) makes the logit.
  float scale_log2;
  // The layer's attention variant (csrc/tpp_schema.h). sliding_window: 0 = none; a row of
  // seq_len L sees positions [L - sliding_window, L). soft_cap_log2 = soft_cap * log2(e) (0 =
  // none), soft_cap_in = scale / soft_cap. sinks: fp32 [num_heads], natural log, nullable.
  int sliding_window;
  float soft_cap_log2, soft_cap_in;
  const float* sinks;
  // An fp8 cache (kv_fp8 = kKvE4m3 / kKvE5m2; kKvNotFp8: K and V are the query's type): the
  // values are read as they are, k_scale is folded into scale_log2 / soft_cap_in and v_scale
  // multiplies the normalised output (1 for other caches).
  int kv_fp8;
  float v_scale;
  // Work decomposition, chosen on the host from host ints only (graph-safe).
  int chunk_splits, seq_splits;
  int chunk_heads, chunk_head_tiles, chunk_seqs, num_windows;
  int seq_heads, seq_head_tiles;
  // Chunk CTAs of the partial grid per kv head: an exact plan's one per (split, window, head
  // tile); a padded plan's one per slot of its capacities or, for large capacities, one wave
  // (make_tpp_work). CTA x runs items x, x + chunk_ctas, ... of the real (split, window) items.
  int chunk_ctas;
  // A plan padded to a graph's capacities (device_splits = 1): chunk_splits = 1 on the host; the
  // CTAs pick the splits from the real plan within num_slots workspace rows (chunk_splits_of).
  int device_splits, num_slots, resident_ctas;
  // Slots a final CTA lists in smem at a time, if fewer than its stage's TileShape::kSlotListCap
  // (tests); 0: as many as that holds.
  int slot_list_cap;
  // KV tokens of each launch's smem stage: default_stage_tokens, or kCompactStageTokens.
  int partial_stage_tokens, final_stage_tokens;
  // 1: V's strides are K's and every element offset into either cache fits int32 (vLLM's flash
  // layout below 2^31 elements a layer): load_kv_stage computes one 32-bit offset a token for
  // both; 0: 64-bit offsets for each (make_tpp_params; CHUNKATTN_KV_OFFSETS_I64=1 forces it).
  int kv_offsets_i32;
};

// The chunk-first splits a launch runs, the partial count its slots are laid out by (split s of
// partial j at slot s * partials + j, the private tails' splits after all of them), its windows
// and its real nodes. Exact plans: the host's choice. Padded plans: the same rule on the real
// counts, read by every warp alike (no barrier), so both kernels of a launch agree.
struct ChunkSplits {
  int splits, partials, windows, nodes;
  // The slot layout, for the kernels that write slots and the merge that reads them.
  __device__ int64_t chunk_slot(int split, int partial) const { return int64_t(split) * partials + partial; }
  __device__ int64_t tail_slot(int seq, int split, int seq_splits) const {  // split >= 1
    return int64_t(splits) * partials + int64_t(seq) * (seq_splits - 1) + (split - 1);
  }
};

// The lowest lane whose `pred` holds (32 if none), in every lane; the whole warp calls it.
__device__ __forceinline__ int warp_first_lane(bool pred) {
  float first = pred ? float(threadIdx.x % 32) : 32.f;
  for (int m = 16; m > 0; m /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, first, m);
    first = other < first ? other : first;
  }
  return int(first);
}

// splits_filling_waves in one step of a warp: lane s - 1 weighs s splits.
__device__ inline int splits_filling_waves_warp(const SplitQuery& q) {
  if (!split_needed(q)) return 1;
  const int s = threadIdx.x % 32 + 1;
  const double fill = s <= q.max_splits ? fill_with(q, s) : 0.0;
  double best = fill;
  for (int m = 16; m > 0; m /= 2) {
    const double other = __shfl_xor_sync(0xffffffffu, best, m);
    best = other > best ? other : best;
  }
  const int first = warp_first_lane(s <= q.max_splits && is_enough(fill, best));
  return first < 32 ? first + 1 : 1;
}

__device__ inline ChunkSplits chunk_splits_of(const TppParams& p) {
  if (!p.device_splits) return {p.chunk_splits, p.num_partials, p.num_windows, p.num_nodes};
  // Padding nodes repeat node_seq_indptr's last value and every real node has >= 2 rows, so the
  // real nodes end at the first n whose indptr is the total: a 32-way search, a load per lane.
  const int* ind = p.node_seq_indptr;
  const int partials = ind[p.num_nodes];
  int lo = 0, hi = p.num_nodes;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int base = lo, step = (hi - lo + 31) / 32, lane = threadIdx.x % 32;
    const int idx = base + lane * step < hi ? base + lane * step : hi;
    const int first = warp_first_lane(ind[idx] == partials);
    if (first == 0) break;  // ind[base] is the total: base is the answer
    lo = base + (first - 1) * step + 1;
    if (first < 32) hi = base + first * step < hi ? base + first * step : hi;
  }
  const int nodes = lo;
  const int windows = nodes == 0 ? 0 : nodes + (partials + p.chunk_seqs - 1) / p.chunk_seqs;
  const int64_t fixed = int64_t(p.seq_splits - 1) * p.num_seqs * p.seq_head_tiles * p.num_kv_heads;
  int splits = splits_filling_waves_warp(chunk_split_query(
      nodes, partials, p.node_block_indptr[p.num_nodes], 1 << p.block_size_log2, p.chunk_seqs,
      int64_t(p.chunk_head_tiles) * p.num_kv_heads, fixed, p.resident_ctas));
  // Within the workspace (one split always fits: the host sized it for the capacities). The
  // grid's chunk CTAs loop over however many (split, window) items this makes.
  while (splits > 1 && int64_t(splits) * partials + int64_t(p.num_seqs) * (p.seq_splits - 1) > p.num_slots)
    --splits;
  return {splits, partials, windows, nodes};
}

}  // namespace chunkattn
