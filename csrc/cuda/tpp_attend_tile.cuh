// One CTA's attention of up to 64 rows against a run of KV tokens, on tensor cores (mma.sync
// m16n8k16, fp32 accumulation): the smem layout, the cp.async KV pipeline, the online softmax
// and the merge of its KV parts' states; a final CTA also merges the row's partial slots
// (tpp_slot_merge.cuh). Both kernels of tpp_kernels.cuh run it.
//
// Inside a CTA (4 warps): warp w owns row block w % WM (16 rows) and KV part w / WM of every
// smem stage of kTokens tokens; KV parts are merged through smem at the end. Softmax runs in the
// log2 domain (scores * scale * log2 e); states leave the kernel with natural-log m.
#pragma once

#include "tpp_params.cuh"
#include "tpp_scores.cuh"
#include "tpp_slot_merge.cuh"

namespace chunkattn {

// ---- Shared-memory layout of one CTA ----
//   [row meta: int64 q offset, int out index, int window edge, each x kMaxRows][Q rows][KV stages]
template <typename T, int D>
struct Smem {
  int64_t* row_q;  // element offset of the row's query vector, -1 = absent row
  int* row_out;    // partial: slot * num_heads + head; final: head; -1 = absent row
  int* row_lo;     // a chunk item's row: its first token of the run inside its sliding window
  T* q;
  T* kv;           // stage s: K at kv + s*2*kTokens*kLd, V right after
  __device__ Smem(char* base, int max_rows) {
    using S = TileShape<D>;
    row_q = reinterpret_cast<int64_t*>(base);
    row_out = reinterpret_cast<int*>(base + kMaxRows * 8);
    row_lo = row_out + kMaxRows;
    q = reinterpret_cast<T*>(base + ((S::kMetaBytes + 15) / 16) * 16);
    kv = q + max_rows * S::kLd;
  }
};

// A KV cache element: the query's 16-bit type T, or a byte of an fp8 cache.
template <typename T, bool FP8>
using KvElem = std::conditional_t<FP8, uint8_t, T>;

// Where a token's K and V rows start (load_kv_stage's two address rules).
template <typename E>
struct KvRows {
  const E* k;
  const E* v;
};

// The chunks of 8 elements (16 bytes of T, 8 of fp8) a thread copies into a stage, token-major:
// copy i of thread x is chunk x + i * kThreads of the stage. Where kThreads is a multiple of the
// kChunks of a row (heads 64, 128, 256), chunk x % kChunks of tokens x / kChunks + i * kThreads /
// kChunks, its offset added once; at head 96 (12 chunks) the chunk moves from copy to copy.
// load_kv_stage copies them; an fp8 stage's thread converts the same chunks (convert_kv_stage),
// so it reads only bytes its own cp.async wait covers.
template <int D, int TOKENS>
struct StageChunks {
  static constexpr int kChunks = D / 8;  // chunks per token row
  static_assert((TOKENS * kChunks) % kThreads == 0, "every thread copies as many chunks");
  static constexpr bool kSameChunk = kThreads % kChunks == 0;
  static constexpr int kPerThread = TOKENS * kChunks / kThreads;
  int x;
  __device__ int tok(int i) const {
    return kSameChunk ? x / kChunks + i * (kThreads / kChunks) : (x + i * kThreads) / kChunks;
  }
  __device__ int chunk(int i) const { return kSameChunk ? 0 : (x + i * kThreads) % kChunks; }
  __device__ int first_chunk() const { return kSameChunk ? x % kChunks : 0; }  // every copy's, or 0 and chunk's
};

template <int kBytes>
__device__ __forceinline__ void cp_async_chunk(void* dst, const void* src, int src_bytes) {
  if constexpr (kBytes == 16) cp_async_16(dst, src, src_bytes);
  else cp_async_8(dst, src, src_bytes);
}

// Token t of a KV run lives in block ids[t >> log2(block_size)] at row t & (block_size - 1).
// A thread's block ids are loaded first, all at once, and the copies issued after: written as
// one loop (id, then its copy), nvcc (13.0, sm_90a) keeps each copy waiting on its own id load
// and a branch, eight dependent load latencies a stage in a row (SASS: LDG.E.CONSTANT -> ~100
// instructions -> LDGSTS, eight times; tests/kernels/test_cuda_codegen.py). FP8: sk / sv are the
// stage's bytes (TileShape::kRawOffset), 8-byte copies.
template <typename T, int D, int TOKENS, bool FP8>
__device__ __forceinline__ void load_kv_stage(const TppParams& p, KvElem<T, FP8>* sk, KvElem<T, FP8>* sv,
                                              const int* ids, int t0, int t_end, int kv_head) {
  using E = KvElem<T, FP8>;
  using S = TileShape<D, TOKENS>;
  using C = StageChunks<D, S::kTokens>;
  constexpr int kCopyBytes = 8 * int(sizeof(E));
  const int mask = (1 << p.block_size_log2) - 1;
  const C chunks{int(threadIdx.x)};
  const int c = chunks.first_chunk();
  int blk[C::kPerThread];
#pragma unroll
  for (int i = 0; i < C::kPerThread; ++i) {
    const int t = t0 + chunks.tok(i);
    blk[i] = t < t_end ? __ldg(ids + (t >> p.block_size_log2)) : 0;
  }
  const E* key_head = static_cast<const E*>(p.key) + kv_head * p.k_stride_head + c * 8;
  const E* value_head = static_cast<const E*>(p.value) + kv_head * p.v_stride_head + c * 8;
  // One loop copies every token; `rows(block id, row in block)` says where its K and V rows are.
  // A token past t_end copies 0 bytes (zero fill) from block 0, row t & mask: an address inside
  // the cache, computed without a branch.
  const auto copy_tokens = [&](const auto& rows) {
#pragma unroll
    for (int i = 0; i < C::kPerThread; ++i) {
      const int tok = chunks.tok(i), t = t0 + tok, ci = chunks.chunk(i) * 8;
      const int bytes = t < t_end ? kCopyBytes : 0;
      const KvRows<E> src = rows(blk[i], t & mask);
      cp_async_chunk<kCopyBytes>(sk + tok * S::kLd + c * 8 + ci, src.k + ci, bytes);
      cp_async_chunk<kCopyBytes>(sv + tok * S::kLd + c * 8 + ci, src.v + ci, bytes);
    }
  };
  if (p.kv_offsets_i32) {
    // One int32 offset a token for K and V (their strides are equal), V a fixed distance from
    // K, instead of two 64-bit multiply-adds a copy: a full stage of the partial launch's
    // 64-row loop, 846 -> 724 instructions (sm_90a SASS, head 128, nvcc 13.0).
    const int k_block = int(p.k_stride_block), k_tok = int(p.k_stride_tok);
    const uintptr_t v_minus_k = reinterpret_cast<uintptr_t>(p.value) - reinterpret_cast<uintptr_t>(p.key);
    copy_tokens([&](int block, int row) {
      const E* k = key_head + (block * k_block + row * k_tok);
      return KvRows<E>{k, reinterpret_cast<const E*>(reinterpret_cast<uintptr_t>(k) + v_minus_k)};
    });
  } else {
    copy_tokens([&](int block, int row) {
      return KvRows<E>{key_head + block * p.k_stride_block + int64_t(row) * p.k_stride_tok,
                       value_head + block * p.v_stride_block + int64_t(row) * p.v_stride_tok};
    });
  }
}

// An fp8 stage's bytes (rk, rv: K and V, rows of kLd bytes) converted to T into the tile (tk,
// tv) the MMAs read, each thread the chunks it copied (StageChunks): exact, the scales are
// applied elsewhere (TppParams::kv_fp8).
template <typename T, int D, int TOKENS, bool E5M2>
__device__ __forceinline__ void convert_kv_stage(T* tk, T* tv, const uint8_t* rk, const uint8_t* rv) {
  using S = TileShape<D, TOKENS>;
  using C = StageChunks<D, S::kTokens>;
  const C chunks{int(threadIdx.x)};
  const int c = chunks.first_chunk();
#pragma unroll
  for (int i = 0; i < C::kPerThread; ++i) {
    const int off = chunks.tok(i) * S::kLd + c * 8 + chunks.chunk(i) * 8;
    fp8x8_to_smem<T, E5M2>(tk + off, rk + off);
    fp8x8_to_smem<T, E5M2>(tv + off, rv + off);
  }
}

// Attention of up to 16*WM rows (described in smem row meta) against tokens [t_begin, t_end) of
// the KV run `ids`, for one kv head, in smem stages of TOKENS tokens. FINAL = false: writes each
// row's state to its slot. FINAL = true: rows are q heads of sequence `seq`; merges the row's
// slots and writes out/lse. seq < 0: a chunk item, whose rows (sharers of a node) each see the
// run from their own window edge (Smem::row_lo); a tail's range is its row's window already
// (tail_range). FP8: the cache is fp8 (TppParams::kv_fp8), each stage converted to T in smem.
template <typename T, int D, int WM, bool FINAL, int TOKENS = TileShape<D>::kTokens, bool FP8 = false>
__device__ void attend_tile(const TppParams& p, const Smem<T, D>& sm, const int* ids, int t_begin,
                            int t_end, int kv_head, int seq) {
  using S = TileShape<D, TOKENS>;
  constexpr int kParts = (kWarps / WM) < S::kMaxParts ? (kWarps / WM) : S::kMaxParts;
  constexpr int kTokW = S::kTokens / kParts;  // tokens of one warp per stage
  constexpr int kLd = S::kLd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rb = warp % WM, part = warp / WM;
  const bool active = part < kParts;
  // The final CTA's slot count, read first: its loads overlap the KV's.
  int k0 = 0, k1 = 0;
  if constexpr (FINAL) {
    k0 = p.seq_partial_indptr[seq];
    k1 = p.seq_partial_indptr[seq + 1];
  }

  // Q rows (absent rows zero-filled) go with the first KV stage's commit group.
  const T* query = static_cast<const T*>(p.query);
  for (int idx = threadIdx.x; idx < 16 * WM * (D / 8); idx += kThreads) {
    const int r = idx / (D / 8), c = idx % (D / 8);
    const int64_t off = sm.row_q[r];
    cp_async_16(sm.q + r * kLd + c * 8, off >= 0 ? query + off + c * 8 : query, off >= 0 ? 16 : 0);
  }
  // A chunk item under a sliding window starts at its rows' lowest edge (no row sees the KV
  // before it); a stage that starts before the highest masks each row's own (mask_window).
  int lo[2] = {0, 0}, lo_hi = 0;
  if (p.sliding_window > 0 && seq < 0) {
    int lo_lo = t_end;
    for (int r = 0; r < 16 * WM; ++r)
      if (sm.row_out[r] >= 0) {
        lo_lo = min(lo_lo, sm.row_lo[r]);
        lo_hi = max(lo_hi, sm.row_lo[r]);
      }
    lo[0] = sm.row_lo[rb * 16 + lane / 4];
    lo[1] = sm.row_lo[rb * 16 + lane / 4 + 8];
    t_begin = max(t_begin, lo_lo);
  }
  const int num_tokens = t_end > t_begin ? t_end - t_begin : 0;
  const int num_stages = (num_tokens + S::kTokens - 1) / S::kTokens;
  constexpr int kStageElems = 2 * S::kTokens * kLd;
  // Where stage s's copies land: its tile (K, then V kTokens rows on), or an fp8 stage's bytes.
  const auto stage_kv = [&sm](int s) -> KvElem<T, FP8>* {
    if constexpr (FP8) return reinterpret_cast<uint8_t*>(sm.kv) + S::kRawOffset + s * kStageElems;
    else return sm.kv + s * kStageElems;
  };
  if (num_stages > 0)
    load_kv_stage<T, D, TOKENS, FP8>(p, stage_kv(0), stage_kv(0) + S::kTokens * kLd, ids, t_begin, t_end,
                                     kv_head);
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int nb = 0; nb < D / 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.f;
  float m2[2] = {-INFINITY, -INFINITY};  // rows lane/4 and lane/4 + 8 of the row block
  float l[2] = {0.f, 0.f};               // this thread's share; quad-summed after the loop

  for (int it = 0; it < num_stages; ++it) {
    if (it + 1 < num_stages) {
      KvElem<T, FP8>* nxt = stage_kv((it + 1) % S::kStages);
      load_kv_stage<T, D, TOKENS, FP8>(p, nxt, nxt + S::kTokens * kLd, ids,
                                       t_begin + (it + 1) * S::kTokens, t_end, kv_head);
    }
    cp_async_commit();
    cp_async_wait<1>();
    if constexpr (FP8) {
      // Into the first stage's tile: the last stage's MMAs read it before the loop's last barrier.
      const uint8_t* raw = stage_kv(it % S::kStages);
      if (p.kv_fp8 == kKvE5m2)
        convert_kv_stage<T, D, TOKENS, true>(sm.kv, sm.kv + S::kTokens * kLd, raw, raw + S::kTokens * kLd);
      else
        convert_kv_stage<T, D, TOKENS, false>(sm.kv, sm.kv + S::kTokens * kLd, raw, raw + S::kTokens * kLd);
    }
    __syncthreads();
    if (active) {
      const T* sq = sm.q + rb * 16 * kLd;
      const T* sk = sm.kv + (FP8 ? 0 : it % S::kStages) * kStageElems + part * kTokW * kLd;
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
      // The soft cap, the rows' window edges (a CTA-uniform branch each), tokens past t_end
      // masked (CTA-uniform, only a run's last stage has any), then the online softmax per row in
      // the log2 domain.
      if (p.soft_cap_log2 > 0.f) soft_cap_scores<kTokW / 8>(s, p.soft_cap_log2, p.soft_cap_in);
      const int tok0 = t_begin + it * S::kTokens + part * kTokW + 2 * (lane % 4);
      if (t_begin + it * S::kTokens < lo_hi) mask_window<kTokW / 8>(s, tok0, lo);
      float mx[2];
      if (t_begin + (it + 1) * S::kTokens <= t_end)
        mask_and_max<false, kTokW / 8>(s, tok0, t_end, mx);
      else
        mask_and_max<true, kTokW / 8>(s, tok0, t_end, mx);
      float ms[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
        const float mn = fmaxf(m2[r], mx[r] * p.scale_log2);
        ms[r] = safe_max(mn);
        alpha[r] = fast_exp2(m2[r] - ms[r]);  // 0 while the state is still empty
        m2[r] = mn;
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
        for (int e = 0; e < 4; ++e) s[nb][e] = fast_exp2(fmaf(s[nb][e], p.scale_log2, -ms[e / 2]));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float v[kTokW / 4];
        row_values<kTokW / 8>(s, r, v);
        l[r] = fmaf(l[r], alpha[r], tree_reduce(v, [](float a, float b) { return a + b; }));
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
  if constexpr (FINAL) {
    // Every warp, before the rows diverge; it reads the plan only, so a padded plan's search
    // runs before the wait, while the partial launch may still be running.
    const ChunkSplits cs = chunk_splits_of(p);
    int* list = reinterpret_cast<int*>(reinterpret_cast<char*>(sm.kv) + S::kRedBytes);
    const int chunk_slots = (k1 - k0) * cs.splits, total = chunk_slots + p.seq_splits - 1;
    // Every thread, whatever its warp (the KV stages were last read before the loop's barrier).
    // As many as the stages hold past the merge buffer: the kernel's own bound, whatever the call.
    const int cap = p.slot_list_cap > 0 && p.slot_list_cap < S::kSlotListCap ? p.slot_list_cap : S::kSlotListCap;
    for (int base = 0; base == 0 || base < total; base += cap) {
      const int n = min(cap, total - base);
      if (base > 0) __syncthreads();  // the last batch is merged
      list_row_slots(p, cs, seq, k0, chunk_slots, base, n, list);
      __syncthreads();
      // A final CTA may run beside the partial launch (overlap_final): its own tail is done; the
      // partial slots are complete and visible only past this point.
      if (base == 0) wait_for_primary_grid();
      if (active) merge_listed_slots<D>(p, sm, list, n, rb, part, kParts, lane, o, m2, l);
    }
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
          a[r] = fast_exp2(m2[r] - ms);
          b[r] = fast_exp2(qm - ms);
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
      // out_idx is the q head; the row's slots were merged (merge_listed_slots). A sink joins
      // the state as a token of zero value: its weight in l, o rescaled to the new max (folded
      // into 1 / l); an empty row with a sink gives out = 0, lse = the sink.
      const int h = out_idx;
      float a = 1.f;
      if (p.sinks != nullptr) {
        const float sink2 = p.sinks[h] * kLog2e;
        const float mn = fmaxf(m2[r], sink2), ms = safe_max(mn);
        a = fast_exp2(m2[r] - ms);
        l[r] = l[r] * a + fast_exp2(sink2 - ms);
        m2[r] = mn;
      }
      const float inv = a * p.v_scale / fmaxf(l[r], 1e-30f);  // empty row: o = 0 stays 0
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

}  // namespace chunkattn
