// TPP decode kernels on tensor cores (mma.sync m16n8k16, fp32 accumulation), framework-free.
//
// Work decomposition (sizes and KV splits chosen on the host: tpp_host.h, make_tpp_work):
//   launch 1, tpp_partial_kernel, grid (chunk CTAs + seq-split CTAs, num_kv_heads):
//     chunk CTA  = (KV split s, window, head tile): the rows of one shared node that fall in one
//                  window of `chunk_seqs` partial positions (windows are aligned in partial space,
//                  so window w of node n is CTA index w + n, found by a binary search over
//                  node_seq_indptr), times up to `chunk_heads` q heads of the kv group; it reads
//                  the node's tokens of split s once for all its rows and writes slot s*P + j.
//     seq CTA    = (row i, split s >= 1, head tile): split s of row i's private tail, written to
//                  slot S_c*P + i*(S_s-1) + s-1.
//   launch 2, tpp_final_kernel, grid (num_seqs * seq head tiles, num_kv_heads): split 0 of row
//     i's private tail, then merges the slots of the row's partials and tail splits in registers,
//     normalises and writes out (and lse). On sm_90+ launch 2 is a programmatic dependent of
//     launch 1 (launch_tpp_decode's overlap_final): its CTAs start on the SMs launch 1's last
//     wave leaves idle, attend their tails, and wait for launch 1's grid before the merge.
// Slots are rows of the fp32 workspace partial_o/m/l [slots, num_heads(, head_size)]: with one
// split each, chunk partial j sits at slot j, exactly the plan's partial index.
//
// Inside a CTA (4 warps): warp w owns row block w % WM (16 rows) and KV part w / WM of every
// smem stage of kTokens tokens; KV parts are merged through smem at the end. Softmax runs in the
// log2 domain (scores * scale * log2 e); states leave the kernel with natural-log m.
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

// exp2 offset for a running max: an empty state (m = -inf) uses 0 so -inf - (-inf) never occurs.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// ---- Shared-memory layout of one CTA ----
//   [row meta: int64 q offset x kMaxRows, int out index x kMaxRows][Q rows][KV stages]
template <typename T, int D>
struct Smem {
  int64_t* row_q;  // element offset of the row's query vector, -1 = absent row
  int* row_out;    // partial: slot * num_heads + head; final: head; -1 = absent row
  T* q;
  T* kv;           // stage s: K at kv + s*2*kTokens*kLd, V right after
  __device__ Smem(char* base, int max_rows) {
    using S = TileShape<D>;
    row_q = reinterpret_cast<int64_t*>(base);
    row_out = reinterpret_cast<int*>(base + kMaxRows * 8);
    q = reinterpret_cast<T*>(base + ((S::kMetaBytes + 15) / 16) * 16);
    kv = q + max_rows * S::kLd;
  }
};

// Token t of a KV run lives in block ids[t >> log2(block_size)] at row t & (block_size - 1).
template <typename T, int D>
__device__ __forceinline__ void load_kv_stage(const TppParams& p, T* sk, T* sv, const int* ids,
                                              int t0, int t_end, int kv_head) {
  using S = TileShape<D>;
  constexpr int kChunks = D / 8;  // 16-byte chunks per token row
  const T* key = static_cast<const T*>(p.key);
  const T* value = static_cast<const T*>(p.value);
  const int mask = (1 << p.block_size_log2) - 1;
  for (int idx = threadIdx.x; idx < S::kTokens * kChunks; idx += kThreads) {
    const int tok = idx / kChunks, c = idx % kChunks, t = t0 + tok;
    const T* gk = key;
    const T* gv = value;
    int bytes = 0;
    if (t < t_end) {
      const int64_t blk = __ldg(ids + (t >> p.block_size_log2));
      const int64_t off = t & mask;
      gk = key + blk * p.k_stride_block + off * p.k_stride_tok + kv_head * p.k_stride_head + c * 8;
      gv = value + blk * p.v_stride_block + off * p.v_stride_tok + kv_head * p.v_stride_head +
           c * 8;
      bytes = 16;
    }
    cp_async_16(sk + tok * S::kLd + c * 8, gk, bytes);
    cp_async_16(sv + tok * S::kLd + c * 8, gv, bytes);
  }
}

// Merges slot `idx` (natural-log m) into a thread's share of one row's state (log2-domain m).
template <int D>
__device__ __forceinline__ void merge_slot(const TppParams& p, int64_t idx, int lane, float o[][4],
                                           int r, float& m2, float& l) {
  const float pm2 = p.partial_m[idx] * kLog2e;  // -inf stays -inf
  const float pl = p.partial_l[idx];
  const float mn = fmaxf(m2, pm2), ms = safe_max(mn);
  const float a = exp2f(m2 - ms), b = exp2f(pm2 - ms);
  const float* po = p.partial_o + idx * D + 2 * (lane % 4);
#pragma unroll
  for (int nb = 0; nb < D / 8; ++nb) {
    const float2 v = *reinterpret_cast<const float2*>(po + nb * 8);
    o[nb][2 * r] = o[nb][2 * r] * a + v.x * b;
    o[nb][2 * r + 1] = o[nb][2 * r + 1] * a + v.y * b;
  }
  l = l * a + pl * b;
  m2 = mn;
}

// Attention of up to 16*WM rows (described in smem row meta) against tokens [t_begin, t_end) of
// the KV run `ids`, for one kv head. FINAL = false: writes each row's state to its slot.
// FINAL = true: rows are q heads of sequence `seq`; merges the row's slots and writes out/lse.
template <typename T, int D, int WM, bool FINAL>
__device__ void attend_tile(const TppParams& p, const Smem<T, D>& sm, const int* ids, int t_begin,
                            int t_end, int kv_head, int seq) {
  using S = TileShape<D>;
  constexpr int kParts = (kWarps / WM) < S::kMaxParts ? (kWarps / WM) : S::kMaxParts;
  constexpr int kTokW = S::kTokens / kParts;  // tokens of one warp per stage
  constexpr int kLd = S::kLd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rb = warp % WM, part = warp / WM;
  const bool active = part < kParts;

  // Q rows (absent rows zero-filled) go with the first KV stage's commit group.
  const T* query = static_cast<const T*>(p.query);
  for (int idx = threadIdx.x; idx < 16 * WM * (D / 8); idx += kThreads) {
    const int r = idx / (D / 8), c = idx % (D / 8);
    const int64_t off = sm.row_q[r];
    cp_async_16(sm.q + r * kLd + c * 8, off >= 0 ? query + off + c * 8 : query, off >= 0 ? 16 : 0);
  }
  const int num_tokens = t_end > t_begin ? t_end - t_begin : 0;
  const int num_stages = (num_tokens + S::kTokens - 1) / S::kTokens;
  constexpr int kStageElems = 2 * S::kTokens * kLd;
  if (num_stages > 0)
    load_kv_stage<T, D>(p, sm.kv, sm.kv + S::kTokens * kLd, ids, t_begin, t_end, kv_head);
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int nb = 0; nb < D / 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.f;
  float m2[2] = {-INFINITY, -INFINITY};  // rows lane/4 and lane/4 + 8 of the row block
  float l[2] = {0.f, 0.f};               // this thread's share; quad-summed after the loop

  for (int it = 0; it < num_stages; ++it) {
    if (it + 1 < num_stages) {
      T* nxt = sm.kv + ((it + 1) % S::kStages) * kStageElems;
      load_kv_stage<T, D>(p, nxt, nxt + S::kTokens * kLd, ids, t_begin + (it + 1) * S::kTokens,
                          t_end, kv_head);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (active) {
      const T* sq = sm.q + rb * 16 * kLd;
      const T* sk = sm.kv + (it % S::kStages) * kStageElems + part * kTokW * kLd;
      const T* sv = sk + S::kTokens * kLd;
      float s[kTokW / 8][4];
#pragma unroll
      for (int nb = 0; nb < kTokW / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, sq + (lane % 16) * kLd + kk * 16 + (lane / 16) * 8);
#pragma unroll
        for (int j = 0; j < kTokW / 16; ++j) {
          uint32_t b[4];  // K rows are tokens: non-transposed B (k = head dim, n = token)
          ldmatrix_x4(b, sk + (j * 16 + (lane % 8) + (lane / 16) * 8) * kLd + kk * 16 +
                             ((lane / 8) % 2) * 8);
          mma_16816<T>(s[2 * j], a, b[0], b[1]);
          mma_16816<T>(s[2 * j + 1], a, b[2], b[3]);
        }
      }
      // Scale into the log2 domain, mask tokens past t_end, online softmax per row.
      const int tok0 = t_begin + it * S::kTokens + part * kTokW + 2 * (lane % 4);
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nb = 0; nb < kTokW / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool valid = tok0 + nb * 8 + (e & 1) < t_end;
          s[nb][e] = valid ? s[nb][e] * p.scale_log2 : -INFINITY;
          mx[e / 2] = fmaxf(mx[e / 2], s[nb][e]);
        }
      float ms[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
        const float mn = fmaxf(m2[r], mx[r]);
        ms[r] = safe_max(mn);
        alpha[r] = exp2f(m2[r] - ms[r]);  // 0 while the state is still empty
        m2[r] = mn;
        l[r] *= alpha[r];
      }
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb) {
        o[nb][0] *= alpha[0];
        o[nb][1] *= alpha[0];
        o[nb][2] *= alpha[1];
        o[nb][3] *= alpha[1];
      }
#pragma unroll
      for (int nb = 0; nb < kTokW / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nb][e] = exp2f(s[nb][e] - ms[e / 2]);
          l[e / 2] += s[nb][e];
        }
      // P (C layout of two n8 blocks) is exactly the A fragment of a k16 step.
#pragma unroll
      for (int ks = 0; ks < kTokW / 16; ++ks) {
        uint32_t pa[4] = {pack2<T>(s[2 * ks][0], s[2 * ks][1]),
                          pack2<T>(s[2 * ks][2], s[2 * ks][3]),
                          pack2<T>(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                          pack2<T>(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
        for (int db = 0; db < D / 16; ++db) {
          uint32_t b[4];  // V rows are tokens: transposed B (k = token, n = head dim)
          ldmatrix_x4_trans(b, sv + (ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * kLd +
                                   db * 16 + (lane / 16) * 8);
          mma_16816<T>(o[2 * db], pa, b[0], b[1]);
          mma_16816<T>(o[2 * db + 1], pa, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the stage is overwritten by the next iteration's prefetch
  }
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
  }

  // Merge the KV parts of each row block through smem (aliases the now idle KV stages).
  if constexpr (kParts > 1) {
    __syncthreads();
    float* red_o = reinterpret_cast<float*>(sm.kv);
    float* red_ml = red_o + (kWarps - 1) * 16 * D;
    if (active && part > 0) {
      const int slot = (part - 1) * WM + rb;
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) red_o[(slot * (D / 2) + nb * 4 + e) * 32 + lane] = o[nb][e];
      if (lane % 4 == 0)
        for (int r = 0; r < 2; ++r) {
          red_ml[(slot * 16 + lane / 4 + 8 * r) * 2] = m2[r];
          red_ml[(slot * 16 + lane / 4 + 8 * r) * 2 + 1] = l[r];
        }
    }
    __syncthreads();
    if (part == 0) {
      for (int q = 1; q < kParts; ++q) {
        const int slot = (q - 1) * WM + rb;
        float a[2], b[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float qm = red_ml[(slot * 16 + lane / 4 + 8 * r) * 2];
          const float ql = red_ml[(slot * 16 + lane / 4 + 8 * r) * 2 + 1];
          const float mn = fmaxf(m2[r], qm), ms = safe_max(mn);
          a[r] = exp2f(m2[r] - ms);
          b[r] = exp2f(qm - ms);
          l[r] = l[r] * a[r] + ql * b[r];
          m2[r] = mn;
        }
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            o[nb][e] = o[nb][e] * a[e / 2] + red_o[(slot * (D / 2) + nb * 4 + e) * 32 + lane] * b[e / 2];
      }
    }
  }
  if (part != 0) return;
  // A final CTA may run beside the partial launch (overlap_final): its own tail is done; the
  // partial slots are complete and visible only past this point.
  if constexpr (FINAL) wait_for_primary_grid();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = rb * 16 + lane / 4 + 8 * r;
    const int out_idx = sm.row_out[row];
    if (out_idx < 0) continue;
    if constexpr (!FINAL) {
      float* po = p.partial_o + int64_t(out_idx) * D + 2 * (lane % 4);
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb)
        *reinterpret_cast<float2*>(po + nb * 8) = make_float2(o[nb][2 * r], o[nb][2 * r + 1]);
      if (lane % 4 == 0) {
        p.partial_m[out_idx] = m2[r] * kLn2;  // natural log; -inf stays -inf
        p.partial_l[out_idx] = l[r];
      }
    } else {
      // out_idx is the q head. Merge order: the row's partials (each over its KV splits), then
      // tail splits 1.. (split 0 is this CTA's own state).
      const int h = out_idx;
      const int k_end = p.seq_partial_indptr[seq + 1];
      for (int k = p.seq_partial_indptr[seq]; k < k_end; ++k) {
        const int j = p.seq_partial_ids[k];
        for (int s = 0; s < p.chunk_splits; ++s)
          merge_slot<D>(p, (int64_t(s) * p.num_partials + j) * p.num_heads + h, lane, o, r,
                        m2[r], l[r]);
      }
      for (int s = 1; s < p.seq_splits; ++s) {
        const int64_t slot = int64_t(p.chunk_splits) * p.num_partials +
                             int64_t(seq) * (p.seq_splits - 1) + (s - 1);
        merge_slot<D>(p, slot * p.num_heads + h, lane, o, r, m2[r], l[r]);
      }
      const float inv = 1.f / fmaxf(l[r], 1e-30f);  // empty row: o = 0 stays 0
      T* out = static_cast<T*>(p.out) + seq * p.out_stride_seq + h * p.out_stride_head +
               2 * (lane % 4);
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb)
        store2<T>(out + nb * 8, o[nb][2 * r] * inv, o[nb][2 * r + 1] * inv);
      if (p.lse != nullptr && lane % 4 == 0)  // natural log; empty row: -inf
        p.lse[seq * p.lse_stride_seq + h * p.lse_stride_head] = m2[r] * kLn2 + logf(l[r]);
    }
  }
}

// The private tail of row i: block_table[i, first_private:], tokens [0, L); split s of n covers
// [s*per, (s+1)*per) with per rounded up to whole smem stages.
struct TailRange {
  const int* ids;
  int t_begin, t_end;
};
template <int D>
__device__ __forceinline__ TailRange tail_range(const TppParams& p, int seq, int split,
                                                int num_splits) {
  const int first = p.seq_num_shared_blocks[seq];
  const int len = p.seq_lens[seq] - (first << p.block_size_log2);
  TailRange t{p.block_table + seq * p.bt_stride + first, 0, 0};
  if (len <= 0) return t;
  constexpr int kT = TileShape<D>::kTokens;
  const int per = ((len + num_splits - 1) / num_splits + kT - 1) / kT * kT;
  t.t_begin = min(len, split * per);
  t.t_end = min(len, t.t_begin + per);
  return t;
}

// Row meta of a sequence-first CTA: the q heads [ht*seq_heads, +seq_heads) of the kv group.
__device__ __forceinline__ void seq_rows(const TppParams& p, int64_t* row_q, int* row_out,
                                         int seq, int kv_head, int ht, int64_t slot) {
  const int r = threadIdx.x;
  if (r < kMaxRows) {
    const int hh = ht * p.seq_heads + r;
    const bool valid = r < p.seq_heads && hh < p.group;
    const int h = kv_head * p.group + hh;
    row_q[r] = valid ? seq * p.q_stride_seq + h * p.q_stride_head : -1;
    row_out[r] = !valid ? -1 : slot < 0 ? h : int(slot * p.num_heads + h);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) tpp_partial_kernel(const TppParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  Smem<T, D> sm(smem_raw, kMaxRows);
  launch_dependents();  // the final launch may take the SMs this grid leaves idle from now on
  const int kv_head = blockIdx.y;
  const int num_chunk_ctas = p.chunk_splits * p.num_windows * p.chunk_head_tiles;
  if (int(blockIdx.x) < num_chunk_ctas) {
    int x = blockIdx.x;
    const int ht = x % p.chunk_head_tiles;
    x /= p.chunk_head_tiles;
    const int win = x % p.num_windows, split = x / p.num_windows;
    // Node n's windows start at CTA floor(indptr[n] / chunk_seqs) + n: strictly increasing in n.
    const int* ind = p.node_seq_indptr;
    int lo = 0, hi = p.num_nodes - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (ind[mid] / p.chunk_seqs + mid <= win) lo = mid; else hi = mid - 1;
    }
    const int n = lo, w = win - n;
    const int p_lo = max(ind[n], w * p.chunk_seqs);
    const int p_hi = min(ind[n + 1], (w + 1) * p.chunk_seqs);
    if (p_lo >= p_hi) return;  // a gap between nodes' windows, or an empty (padding) node
    const int num_rows = (p_hi - p_lo) * p.chunk_heads;
    const int r = threadIdx.x;
    if (r < kMaxRows) {
      const int j = r / p.chunk_heads, hh = ht * p.chunk_heads + r % p.chunk_heads;
      const bool valid = r < num_rows && hh < p.group;
      const int h = kv_head * p.group + hh;
      sm.row_q[r] = valid ? p.node_seq_ids[p_lo + j] * p.q_stride_seq + h * p.q_stride_head : -1;
      sm.row_out[r] =
          valid ? int((int64_t(split) * p.num_partials + p_lo + j) * p.num_heads + h) : -1;
    }
    __syncthreads();
    const int b0 = p.node_block_indptr[n];
    const int len = (p.node_block_indptr[n + 1] - b0) << p.block_size_log2;
    constexpr int kT = TileShape<D>::kTokens;
    const int per = ((len + p.chunk_splits - 1) / p.chunk_splits + kT - 1) / kT * kT;
    const int t_begin = min(len, split * per), t_end = min(len, t_begin + per);
    const int* ids = p.node_block_ids + b0;
    // Fewer rows -> more warps split the KV instead (an empty split still writes m = -inf).
    if (num_rows <= 16)
      attend_tile<T, D, 1, false>(p, sm, ids, t_begin, t_end, kv_head, -1);
    else if (num_rows <= 32)
      attend_tile<T, D, 2, false>(p, sm, ids, t_begin, t_end, kv_head, -1);
    else
      attend_tile<T, D, 4, false>(p, sm, ids, t_begin, t_end, kv_head, -1);
  } else {
    int x = blockIdx.x - num_chunk_ctas;
    const int ht = x % p.seq_head_tiles;
    x /= p.seq_head_tiles;
    const int split = 1 + x % (p.seq_splits - 1), seq = x / (p.seq_splits - 1);
    const int64_t slot = int64_t(p.chunk_splits) * p.num_partials +
                         int64_t(seq) * (p.seq_splits - 1) + (split - 1);
    seq_rows(p, sm.row_q, sm.row_out, seq, kv_head, ht, slot);
    __syncthreads();
    const TailRange t = tail_range<D>(p, seq, split, p.seq_splits);
    attend_tile<T, D, 1, false>(p, sm, t.ids, t.t_begin, t.t_end, kv_head, seq);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) tpp_final_kernel(const TppParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  Smem<T, D> sm(smem_raw, 16);
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.x / p.seq_head_tiles, ht = blockIdx.x % p.seq_head_tiles;
  seq_rows(p, sm.row_q, sm.row_out, seq, kv_head, ht, -1);
  __syncthreads();
  const TailRange t = tail_range<D>(p, seq, 0, p.seq_splits);
  attend_tile<T, D, 1, true>(p, sm, t.ids, t.t_begin, t.t_end, kv_head, seq);
}

// Grids (x; y is num_kv_heads) and dynamic smem of the two launches, all from host ints, so a
// captured graph replays them as is. The CPU emulation launches the same shapes.
struct TppLaunchShape {
  int partial_grid_x, final_grid_x, partial_smem, final_smem;
};
template <int D>
inline TppLaunchShape tpp_launch_shape(const TppParams& p) {
  using S = TileShape<D>;
  return {p.chunk_splits * p.num_windows * p.chunk_head_tiles +
              p.num_seqs * (p.seq_splits - 1) * p.seq_head_tiles,
          p.num_seqs * p.seq_head_tiles, tpp_partial_smem_bytes(D), S::smem_bytes(16)};
}

#ifndef CHUNKATTN_SIMT_EMULATION
// overlap_final (sm_90+): the final launch is a programmatic dependent of the partial one, so
// its CTAs take the SMs the partial launch's last wave leaves idle and attend their private tails
// meanwhile; they wait for the partial grid before merging its slots (wait_for_primary_grid).
template <typename T, int D>
cudaError_t launch_tpp_decode(const TppParams& p, cudaStream_t stream, bool overlap_final) {
  const TppLaunchShape shape = tpp_launch_shape<D>(p);
  // Opting in to > 48 KB of dynamic smem is a host-side attribute of the current context, not a
  // stream op (allowed while a graph is captured): set on every launch, so a new context (after
  // a device reset) or another thread never launches without it.
  cudaError_t attr = cudaFuncSetAttribute(tpp_partial_kernel<T, D>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, shape.partial_smem);
  if (attr != cudaSuccess) return attr;
  attr = cudaFuncSetAttribute(tpp_final_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              shape.final_smem);
  if (attr != cudaSuccess) return attr;
  if (shape.partial_grid_x > 0) {
    tpp_partial_kernel<T, D><<<dim3(shape.partial_grid_x, p.num_kv_heads), kThreads, shape.partial_smem,
                               stream>>>(p);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (shape.final_grid_x > 0) {
    cudaLaunchAttribute overlap[1] = {};
    overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(shape.final_grid_x, p.num_kv_heads);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = shape.final_smem;
    cfg.stream = stream;
    cfg.attrs = overlap;
    cfg.numAttrs = overlap_final && shape.partial_grid_x > 0 ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, tpp_final_kernel<T, D>, p);
  }
  return cudaSuccess;
}

// Partial-kernel CTAs one SM runs at once, registers and shared memory both counted (ptxas,
// sm_90a: 151 registers at head 64 allow 3, not the 4 its shared memory would), 0 if the runtime
// cannot tell. The split choice (tpp_host.h) sizes its waves by it.
template <typename T, int D>
int tpp_partial_ctas_per_sm() {
  const int smem = tpp_partial_smem_bytes(D);
  int n = 0;
  if (cudaFuncSetAttribute(tpp_partial_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, tpp_partial_kernel<T, D>, kThreads, smem) != cudaSuccess) {
    (void)cudaGetLastError();  // not the launch's error: the launch checks cudaGetLastError
    return 0;
  }
  return n;
}

// One dtype's instantiations: PREFIX empty in tpp_kernels_{fp16,bf16}.cu (one file per dtype so
// the two compile in parallel), `extern` for every other includer; the signatures live here only.
#define CHUNKATTN_TPP_INSTANCES(PREFIX, T)                                                        \
  PREFIX template cudaError_t launch_tpp_decode<T, 64>(const TppParams&, cudaStream_t, bool);  \
  PREFIX template cudaError_t launch_tpp_decode<T, 128>(const TppParams&, cudaStream_t, bool); \
  PREFIX template cudaError_t launch_tpp_decode<T, 256>(const TppParams&, cudaStream_t, bool); \
  PREFIX template int tpp_partial_ctas_per_sm<T, 64>();                                         \
  PREFIX template int tpp_partial_ctas_per_sm<T, 128>();                                        \
  PREFIX template int tpp_partial_ctas_per_sm<T, 256>();
#ifndef CHUNKATTN_INSTANTIATE
CHUNKATTN_TPP_INSTANCES(extern, __half)
CHUNKATTN_TPP_INSTANCES(extern, __nv_bfloat16)
#endif
#endif  // CHUNKATTN_SIMT_EMULATION

}  // namespace chunkattn
