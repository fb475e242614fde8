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

namespace chunkattn {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRows = 16 * kWarps;  // rows of a chunk CTA: sharers x q heads of a kv group
constexpr int kSeqHeads = 16;          // q heads of a sequence-first CTA: one m16 row block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D>
struct TileShape {
  static constexpr int kTokens = D <= 128 ? 64 : 32;  // KV tokens per smem stage
  static constexpr int kLd = D + 8;       // padded smem row: 8 ldmatrix rows hit distinct banks
  static constexpr int kStages = 2;       // cp.async double buffering
  static constexpr int kMaxParts = kTokens / 16;  // a KV part needs >= 16 tokens (one PV k-step)
  static constexpr int kMetaBytes = kMaxRows * (8 + 4);
  static constexpr int kKvBytes = kStages * 2 * kTokens * kLd * 2;
  static constexpr int kRedBytes = (kWarps - 1) * 16 * (D + 2) * 4;
  static_assert(kRedBytes <= kKvBytes, "KV-part merge buffer aliases the KV stages");
  static constexpr int smem_bytes(int max_rows) {
    return ((kMetaBytes + 15) / 16) * 16 + max_rows * kLd * 2 + kKvBytes;
  }
};

// Dynamic shared memory of the partial kernel (the larger launch) for a head size. Head 256
// needs 102144 bytes, over the 99 KB (101376) a block gets on sm_86/89/120 (A10, L4, RTX 30-50):
// vllm_chunkattn/ops/cuda_fit.py refuses that pairing when vLLM selects the backend.
constexpr int tpp_partial_smem_bytes(int head_size) {
  return head_size == 64    ? TileShape<64>::smem_bytes(kMaxRows)
         : head_size == 128 ? TileShape<128>::smem_bytes(kMaxRows)
                            : TileShape<256>::smem_bytes(kMaxRows);
}

// The one dispatch over the kernel's instantiations (fp16 / bf16 x head 64 / 128 / 256; the op
// checked the head size): calls f(DtypeTag<T>{}, std::integral_constant<int, D>{}).
template <typename T>
struct DtypeTag {
  using type = T;
};
template <typename F>
decltype(auto) with_tpp_types(bool half, int head_size, F&& f) {
  using I64 = std::integral_constant<int, 64>;
  using I128 = std::integral_constant<int, 128>;
  using I256 = std::integral_constant<int, 256>;
  if (head_size == 64) return half ? f(DtypeTag<__half>{}, I64{}) : f(DtypeTag<__nv_bfloat16>{}, I64{});
  if (head_size == 128) return half ? f(DtypeTag<__half>{}, I128{}) : f(DtypeTag<__nv_bfloat16>{}, I128{});
  return half ? f(DtypeTag<__half>{}, I256{}) : f(DtypeTag<__nv_bfloat16>{}, I256{});
}

// Everything a launch reads. Strides are in elements; the last dim of every tensor is dense.
struct TppParams {
  const void* query;
  int64_t q_stride_seq, q_stride_head;
  const void* key;
  int64_t k_stride_block, k_stride_tok, k_stride_head;
  const void* value;
  int64_t v_stride_block, v_stride_tok, v_stride_head;
  const int* block_table;
  int64_t bt_stride;
  const int* seq_lens;
  const int* node_block_indptr;
  const int* node_block_ids;
  const int* node_seq_indptr;
  const int* node_seq_ids;
  const int* seq_partial_indptr;
  const int* seq_partial_ids;
  const int* seq_num_shared_blocks;
  float* partial_o;  // [slots, num_heads, D] contiguous
  float* partial_m;  // [slots, num_heads] contiguous
  float* partial_l;
  void* out;
  int64_t out_stride_seq, out_stride_head;
  float* lse;  // nullable
  int64_t lse_stride_seq, lse_stride_head;
  int num_seqs, num_nodes, num_partials, num_heads, num_kv_heads, group;
  int block_size_log2;
  float scale_log2;  // softmax scale * log2(e)
  // Work decomposition, chosen on the host from host ints only (graph-safe).
  int chunk_splits, seq_splits;
  int chunk_heads, chunk_head_tiles, chunk_seqs, num_windows;
  int seq_heads, seq_head_tiles;
};

}  // namespace chunkattn
