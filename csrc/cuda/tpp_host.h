// Host side of the CUDA TPP launch that does not touch the GPU: what the tensor-core kernel adds
// to the shared contract (csrc/tpp_checks.h), and the TppParams of a call, work decomposition and
// split-KV choice included. The CUDA op (tpp_decode.cu) and its CPU emulation
// (csrc/cuda_emu/tpp_decode_emulated.cpp) both call these, so the emulation runs the op's own
// host logic, not a copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "../tpp_checks.h"
#include "tpp_kernels.cuh"

namespace chunkattn {

inline int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

inline int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

// The partial launch's smem stage: the head size's default, or the compact stage where
// CHUNKATTN_PARTIAL_STAGE_TOKENS=32 asks for it (benchmarks, tests; tpp_params.cuh,
// partial_min_ctas). Read per call, by the op's occupancy query and its TppParams alike.
inline int partial_stage_tokens(int64_t head_size) {
  return env_int("CHUNKATTN_PARTIAL_STAGE_TOKENS") == kCompactStageTokens ? kCompactStageTokens
                                                                          : default_stage_tokens(int(head_size));
}

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

inline bool is_fp8_kv(const at::Tensor& key_cache) {
  return key_cache.scalar_type() == at::kFloat8_e4m3fn || key_cache.scalar_type() == at::kFloat8_e5m2;
}

// The kernel's own limits on top of check_tpp_args: fp16/bf16 queries over a cache of their dtype
// or fp8 (e4m3fn / e5m2, value_cache's dtype is key_cache's), its head sizes, power-of-two
// blocks, rows of 8-element chunks for cp.async / ldmatrix, pairs for the float2 / half2 accesses.
inline void check_tensor_core_args(const TppSizes& s, const TppArgs& a) {
  const at::Tensor &query = a.query, &out = a.out;
  TORCH_CHECK(!s.kv_amx_packed, "tpp_decode: CPU_ATTN's AMX cache layout is read on CPUs only");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "tpp_decode: the CUDA TPP kernel takes fp16/bf16 query (tensor cores), got ", dtype,
              "; use kernel='reference' for fp32");
  TORCH_CHECK((a.key_cache.scalar_type() == dtype || is_fp8_kv(a.key_cache)) && out.scalar_type() == dtype,
              "tpp_decode: on CUDA key_cache must have the query's dtype ", dtype,
              " or be float8_e4m3fn / float8_e5m2, and out the query's dtype; got ", a.key_cache.scalar_type(),
              " and ", out.scalar_type());
  TORCH_CHECK(s.head_size == 64 || s.head_size == 96 || s.head_size == 128 || s.head_size == 256,
              "tpp_decode: head_size must be 64, 96, 128 or 256 on CUDA, got ", s.head_size);
  TORCH_CHECK(s.block_size > 0 && (s.block_size & (s.block_size - 1)) == 0,
              "tpp_decode: block_size must be a power of two on CUDA, got ", s.block_size);
  TORCH_CHECK(query.stride(0) % 8 == 0 && query.stride(1) % 8 == 0 && aligned16(query),
              "tpp_decode: query strides must be multiples of 8 elements and its data 16-byte aligned on CUDA");
  for (const at::Tensor* t : {&a.key_cache, &a.value_cache})
    TORCH_CHECK(t->stride(3) == 1 && t->stride(0) % 8 == 0 && t->stride(1) % 8 == 0 && t->stride(2) % 8 == 0 &&
                    aligned16(*t),
                "tpp_decode: key_cache and value_cache must be dense in head_size (flash layout), other strides "
                "multiples of 8 elements, data 16-byte aligned on CUDA, got strides ", t->strides());
  TORCH_CHECK(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
              "tpp_decode: out strides must be even and its data 4-byte aligned on CUDA");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(a.partial_o.data_ptr()) % 8 == 0,
              "tpp_decode: partial_o's data must be 8-byte aligned on CUDA (read as float2)");
}

// A padded plan's chunk CTAs loop over its items when a grid for its capacities would be more
// than this many waves (make_tpp_work).
constexpr int64_t kLoopWaves = 6;

// How one call's work is cut into CTAs: the TppParams fields of that name (tpp_params.cuh).
struct TppWork {
  int chunk_heads, chunk_head_tiles, chunk_seqs, num_windows;
  int seq_heads, seq_head_tiles;
  int chunk_splits, seq_splits;
  int chunk_ctas;     // chunk CTAs in the partial grid per kv head
  int device_splits;  // a padded plan: the CTAs choose chunk_splits (tpp_params.cuh)
};

// The work decomposition from host ints only (sizes, the workspace's slots, the CTAs the device
// runs at once), so a captured CUDA graph replays it. `node_blocks`: node_block_ids' length;
// `table_width`: the block table's columns (the only host-side bound of a private tail, with
// `sliding_window`, 0 = none: a tail's visible tokens).
inline TppWork make_tpp_work(const TppSizes& s, int64_t node_blocks, int64_t table_width, int64_t slots,
                             int64_t resident_ctas, int64_t sliding_window = 0) {
  const int group = int(s.num_heads / s.num_kv_heads), num_nodes = int(s.num_nodes);
  const int64_t num_partials = s.num_partials, num_seqs = s.num_seqs;
  TppWork w{};
  // Rows of a chunk CTA: chunk_seqs sharers x chunk_heads q heads of the group (<= 64).
  w.chunk_heads = std::min(group, kMaxRows);
  w.chunk_head_tiles = ceil_div(group, w.chunk_heads);
  w.chunk_seqs = kMaxRows / w.chunk_heads;
  w.num_windows = num_nodes == 0 ? 0 : num_nodes + ceil_div(num_partials, w.chunk_seqs);
  w.seq_heads = std::min(group, kSeqHeads);
  w.seq_head_tiles = ceil_div(group, w.seq_heads);

  // KV splits: no split under ~256 (node) / 512 (tail) tokens a CTA, at most 16, sized to the
  // waves of the device's resident CTAs (the tails first: their CTAs share the partial launch
  // with the chunk CTAs), then lowered to what the workspace's spare slots hold.
  // CHUNKATTN_{CHUNK,SEQ}_SPLITS override (tests, benchmarks).
  const int64_t resident = std::max<int64_t>(1, resident_ctas);
  const int64_t seq_ctas = num_seqs * w.seq_head_tiles * s.num_kv_heads;
  int64_t tail_tokens = table_width * s.block_size;
  if (sliding_window > 0) tail_tokens = std::min(tail_tokens, sliding_window);
  const int max_ss = int(std::max<int64_t>(1, std::min<int64_t>(16, tail_tokens / 512)));
  int ss = splits_filling_waves(SplitQuery{seq_ctas, 0, max_ss, resident});
  int cs = splits_filling_waves(chunk_split_query(num_nodes, num_partials, node_blocks, int(s.block_size),
                                                  w.chunk_seqs, int64_t(w.chunk_head_tiles) * s.num_kv_heads,
                                                  (ss - 1) * seq_ctas, resident));
  const int forced_cs = env_int("CHUNKATTN_CHUNK_SPLITS");
  if (forced_cs > 0) cs = forced_cs;
  if (env_int("CHUNKATTN_SEQ_SPLITS") > 0) ss = env_int("CHUNKATTN_SEQ_SPLITS");
  // A plan padded to a CUDA graph's capacities has num_seqs - 1 nodes (the most a tree of its
  // rows has; plan_capacity.py), most of them empty: its shapes say nothing of the tree a replay
  // holds, and the rule above, reading the padding as work, would pick one split. Its CTAs choose
  // instead (chunk_splits_of). (An exact plan of that many nodes takes this path too: the same
  // choice and work.) Their grid: a CTA per (window, split) slot of the capacities' windows or a
  // single node's windows at the most splits, whichever is more, each running one item of the
  // real tree or none; or, where that grid is over kLoopWaves waves of resident CTAs, one wave of
  // CTAs that loop over the real items (tpp_kernels.cuh). Why both (H200, bench kernel --grid gpu,
  // captured capacity plans against eager): at b = 256 the capacity grid (9.7 waves, 2552 CTAs,
  // most of them finding they have nothing to do) takes up to 1.39x the eager time and the loop
  // 1.12x; at b <= 128 (<= 4.8 waves) the loop's static share of items takes up to 1.77x (uneven
  // or gapped windows, no overlap with the final launch) and the grid 1.21x.
  w.device_splits = num_nodes > 0 && num_nodes == num_seqs - 1 && forced_cs <= 0;
  if (w.device_splits) cs = 1;
  while (int64_t(cs) * num_partials + num_seqs * (ss - 1) > slots) {
    if (ss > 1) --ss;
    else --cs;  // cs == 1 always fits: slots >= num_partials
  }
  w.chunk_ctas = cs * w.num_windows * w.chunk_head_tiles;
  if (w.device_splits) {
    const int64_t grid = int64_t(std::max<int>(w.num_windows, kMaxChunkSplits * (1 + ceil_div(num_seqs, w.chunk_seqs)))) *
                         w.chunk_head_tiles;
    w.chunk_ctas = grid * s.num_kv_heads > kLoopWaves * resident ? std::max(1, ceil_div(resident, s.num_kv_heads))
                                                                 : int(grid);
  }
  w.chunk_splits = cs;
  w.seq_splits = ss;
  return w;
}

// Whether K and V share their strides and every element offset a (block, token) pair reaches
// fits int32 (load_kv_stage's short address path, TppParams::kv_offsets_i32).
inline bool kv_offsets_fit_i32(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  for (int d = 0; d < 3; ++d)
    if (key_cache.stride(d) != value_cache.stride(d)) return false;
  const int64_t last = (key_cache.size(0) - 1) * key_cache.stride(0) + (key_cache.size(1) - 1) * key_cache.stride(1);
  return last < (int64_t(1) << 31);
}

// Pointers, strides and the work decomposition of one call. `resident_ctas`: partial-kernel CTAs
// the device runs at once (SMs x CTAs per SM); only host ints are read, so a captured CUDA graph
// replays the result.
inline TppParams make_tpp_params(const TppSizes& s, const TppArgs& a, int64_t resident_ctas) {
  const at::Tensor &query = a.query, &key_cache = a.key_cache, &value_cache = a.value_cache;
  const TppPlanTensors& plan = a.plan;
  const int64_t slots = std::min({a.partial_o.size(0), a.partial_m.size(0), a.partial_l.size(0)});
  TORCH_CHECK(slots * s.num_heads < (int64_t(1) << 31), "tpp_decode: partial workspace too large for int32 indexing");
  TppParams p{};
  p.query = query.data_ptr();
  p.q_stride_seq = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.key = key_cache.data_ptr();
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_tok = key_cache.stride(1);
  p.k_stride_head = key_cache.stride(2);
  p.value = value_cache.data_ptr();
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_tok = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  static_cast<PlanArrays&>(p) = plan_arrays(plan);
  p.partial_o = a.partial_o.data_ptr<float>();
  p.partial_m = a.partial_m.data_ptr<float>();
  p.partial_l = a.partial_l.data_ptr<float>();
  p.out = a.out.data_ptr();
  p.out_stride_seq = a.out.stride(0);
  p.out_stride_head = a.out.stride(1);
  p.lse = a.lse.has_value() ? a.lse->data_ptr<float>() : nullptr;
  p.lse_stride_seq = a.lse.has_value() ? a.lse->stride(0) : 0;
  p.lse_stride_head = a.lse.has_value() ? a.lse->stride(1) : 0;
  p.num_seqs = int(s.num_seqs);
  p.num_nodes = int(s.num_nodes);
  p.num_partials = int(s.num_partials);
  p.num_heads = int(s.num_heads);
  p.num_kv_heads = int(s.num_kv_heads);
  p.group = p.num_heads / p.num_kv_heads;
  p.block_size_log2 = __builtin_ctz(unsigned(s.block_size));
  // An fp8 cache holds K / k_scale and V / v_scale (csrc/tpp_schema.h): q . K = (scale * k_scale)
  // q . cache, before any soft cap; the output's V weights sum to 1, so v_scale scales it last.
  const bool fp8 = is_fp8_kv(key_cache);
  p.kv_fp8 = !fp8 ? kKvNotFp8 : key_cache.scalar_type() == at::kFloat8_e5m2 ? kKvE5m2 : kKvE4m3;
  const double qk_scale = fp8 ? a.scale * a.k_scale : a.scale;
  p.v_scale = fp8 ? float(a.v_scale) : 1.f;
  p.scale_log2 = a.soft_cap > 0 ? 1.f : float(qk_scale) * kLog2e;
  p.sliding_window = int(std::min<int64_t>(a.sliding_window, INT32_MAX));
  p.soft_cap_log2 = a.soft_cap > 0 ? float(a.soft_cap * kLog2e) : 0.f;
  p.soft_cap_in = a.soft_cap > 0 ? float(qk_scale / a.soft_cap) : 0.f;
  p.sinks = a.sinks.has_value() ? a.sinks->data_ptr<float>() : nullptr;

  const TppWork w = make_tpp_work(s, plan.node_block_ids.size(0), plan.block_table.size(1), slots, resident_ctas,
                                  a.sliding_window);
  p.chunk_heads = w.chunk_heads;
  p.chunk_head_tiles = w.chunk_head_tiles;
  p.chunk_seqs = w.chunk_seqs;
  p.num_windows = w.num_windows;
  p.seq_heads = w.seq_heads;
  p.seq_head_tiles = w.seq_head_tiles;
  p.chunk_splits = w.chunk_splits;
  p.seq_splits = w.seq_splits;
  p.chunk_ctas = w.chunk_ctas;
  p.device_splits = w.device_splits;
  p.num_slots = int(slots);
  p.resident_ctas = int(std::max<int64_t>(1, resident_ctas));
  // The final launch streams its tails in the compact stage (tpp_params.cuh, kCompactStageTokens):
  // faster than the partial launch's stage at 7 of 8 points timed on an H100 and an H200
  // (benchmarks/results/gpu_h100.md). CHUNKATTN_FINAL_STAGE_TOKENS=64 (benchmarks, tests): the
  // default stage (64 tokens at head <= 128; head 256 has only the 32-token one).
  p.partial_stage_tokens = partial_stage_tokens(s.head_size);
  const int default_stage = default_stage_tokens(int(s.head_size));
  p.final_stage_tokens = env_int("CHUNKATTN_FINAL_STAGE_TOKENS") == default_stage ? default_stage
                                                                                  : kCompactStageTokens;
  // CHUNKATTN_SLOT_LIST_CAP (tests): a shorter list, so a row's slots are merged in batches.
  p.slot_list_cap = std::max(0, env_int("CHUNKATTN_SLOT_LIST_CAP"));
  p.kv_offsets_i32 = kv_offsets_fit_i32(key_cache, value_cache) && env_int("CHUNKATTN_KV_OFFSETS_I64") != 1;
  return p;
}

}  // namespace chunkattn
