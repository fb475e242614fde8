// The attend kernel for bf16 KV and bf16 query on AVX512_BF16 (Cooper Lake, Sapphire Rapids,
// Zen 4 and later): both products run on vdpbf16ps (32 bf16 MACs per instruction, fp32
// accumulation), twice the fp32-FMA rate. Softmax stays fp32; only p is rounded to bf16 for P.V,
// as in every bf16 flash-attention kernel (l is summed from the unrounded p).
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "tpp_attend.h"

#define CHUNKATTN_ISA_AVX512
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace chunkattn_cpu {
namespace {
#include "vec_isa.h"
#include "attend_impl.h"
#include "bf16_pair_tiles.h"

// ---- the kernel: GEMM-shaped, for many rows (chunk-first) and few (sequence-first) alike.
//
// The KV run is walked in chunks of up to kChunk tokens, packed once per chunk into the VNNI pair
// layouts of bf16_pair_tiles.h (kp row stride = chunk length); CPU_ATTN's AMX-layout cache
// already holds them, so only its partial tiles are packed. Rows go in blocks of kRowBlock whose o, m, l live
// in a dense local scratch (in L1) for the whole chunk, and each block streams over the packed
// chunk (from L2) in key tiles of kKeyTile: S = Q.K^T by a 4 rows x 64 keys register block
// (16 zmm accumulators; each K vector load feeds 4 rows, each q broadcast 4 key vectors), online
// softmax per row in fp32, then O = alpha * O + P.V by a 4 rows x 64 dims register block. The
// output state in the workspace is strided by sequence (16 KB apart, L1 set conflicts), so it is
// touched only once per (row block, chunk).
constexpr int kChunk = 512;
constexpr int kRowBlock = 32;

// s[r][0:64] = q[r] . k[t] for RT rows; q as [RT][D/2] pairs, the keys' pairs as pt says.
template <int D, int RT>
inline void qk_block(const uint32_t* q, const PairTile& pt, float* s) {
  constexpr int NV = kKeyTile / 16;
  __m512 acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh k[NV];
    for (int j = 0; j < NV; ++j) k[j] = as_bh(_mm512_loadu_si512(pt.k[j] + p * pt.kps));
    for (int r = 0; r < RT; ++r) {
      __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * (D / 2) + p])));
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qb, k[j]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(s + r * kKeyTile + j * 16, acc[r][j]);
}

template <int D, int RT>
inline void qk_rows(const uint32_t* q, const PairTile& pt, float* s, int rows) {
  for (; rows >= RT; rows -= RT, q += RT * (D / 2), s += RT * kKeyTile) qk_block<D, RT>(q, pt, s);
  if constexpr (RT > 1) {
    if (rows > 0) qk_rows<D, RT / 2>(q, pt, s, rows);
  }
}

// o[r] = alpha[r] * o[r] + p[r] . V for RP rows; p as [RP][32] pairs, the tile's 32 token pairs
// as pt says, o dense [RP][D].
template <int D, int RP>
inline void pv_block(const uint32_t* p, const float* alpha, const PairTile& pt, float* o) {
  constexpr int NV = D / 16;
  constexpr int DB = exact_block(NV, 4);  // RP x DB <= 16 accumulators
  for (int c0 = 0; c0 < NV; c0 += DB) {
    __m512 acc[RP][DB];
    for (int r = 0; r < RP; ++r) {
      __m512 al = _mm512_set1_ps(alpha[r]);
      for (int j = 0; j < DB; ++j) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + (c0 + j) * 16), al);
    }
    for (int h = 0; h < 2; ++h) {
      const uint32_t* vh = pt.v[h] + c0 * pt.vds[h];
      for (int u = 0; u < 16; ++u) {
        __m512bh v[DB];
        for (int j = 0; j < DB; ++j) v[j] = as_bh(_mm512_loadu_si512(vh + u * pt.vps + j * pt.vds[h]));
        for (int r = 0; r < RP; ++r) {
          __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * (kKeyTile / 2) + 16 * h + u])));
          for (int j = 0; j < DB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pb, v[j]);
        }
      }
    }
    for (int r = 0; r < RP; ++r)
      for (int j = 0; j < DB; ++j) _mm512_storeu_ps(o + r * D + (c0 + j) * 16, acc[r][j]);
  }
}

template <int D, int RP>
inline void pv_rows(const uint32_t* p, const float* alpha, const PairTile& pt, float* o, int rows) {
  for (; rows >= RP; rows -= RP, p += RP * (kKeyTile / 2), alpha += RP, o += RP * D)
    pv_block<D, RP>(p, alpha, pt, o);
  if constexpr (RP > 1) {
    if (rows > 0) pv_rows<D, RP / 2>(p, alpha, pt, o, rows);
  }
}

template <int D>
void attend_bf16(const AttendArgs& a) {
  // Few rows (sequence-first): one key tile per chunk, so the packed tile stays in L1.
  const int chunk = a.num_rows > kRowBlock ? kChunk : kKeyTile;
  uint32_t* kp = bf16_scratch(size_t(chunk) * D);  // [D/2][chunk] then [chunk/2][D]
  uint32_t* vp = kp + size_t(chunk) * D / 2;
  alignas(64) float o[kRowBlock * D];
  alignas(64) float s[kRowBlock * kKeyTile];
  alignas(64) uint32_t pb[kRowBlock * kKeyTile / 2];
  float m[kRowBlock], l[kRowBlock], alpha[kRowBlock];
  const uint32_t* q = static_cast<const uint32_t*>(a.q);
  init_states(a, D);
  const int seen = first_seen_key(a);
  for (int c0 = first_visible_key(a, kKeyTile); c0 < a.num_tokens; c0 += chunk) {
    const int cn = imin(chunk, a.num_tokens - c0);
    const int padded = (cn + kKeyTile - 1) / kKeyTile * kKeyTile;
    for (int i = 0; i < padded; i += kTile) pack_tile<D>(a, c0, i, imin(kTile, cn - i), seen, kp, chunk, vp);
    if (c0 + chunk < a.num_tokens) prefetch_tokens<D>(a, c0 + chunk, imin(chunk, a.num_tokens - c0 - chunk));
    for (int r0 = 0; r0 < a.num_rows; r0 += kRowBlock) {
      const int rt = imin(kRowBlock, a.num_rows - r0);
      for (int r = 0; r < rt; ++r) {
        std::memcpy(o + r * D, o_row(a, r0 + r, D), D * 4);
        m[r] = *m_row(a, r0 + r);
        l[r] = *l_row(a, r0 + r);
      }
      for (int t = 0; t < cn; t += kKeyTile) {
        const PairTile pt = tile_at<D>(a, c0, t, seen, kp, chunk, vp);
        qk_rows<D, 4>(q + r0 * (D / 2), pt, s, rt);
        softmax_rows(a, r0, c0 + t, s, pb, m, l, alpha, rt, imin(kKeyTile, cn - t));
        pv_rows<D, 4>(pb, alpha, pt, o, rt);
      }
      for (int r = 0; r < rt; ++r) {
        std::memcpy(o_row(a, r0 + r, D), o + r * D, D * 4);
        *m_row(a, r0 + r) = m[r];
        *l_row(a, r0 + r) = l[r];
      }
    }
  }
}

}  // namespace

AttendFn attend_avx512_bf16(int head_size) {
  switch (head_size) {
    case 64: return &attend_bf16<64>;
    case 80: return &attend_bf16<80>;
    case 96: return &attend_bf16<96>;
    case 128: return &attend_bf16<128>;
    case 256: return &attend_bf16<256>;
    default: return nullptr;
  }
}

// Outside the anonymous namespace: one buffer a thread, shared with the AMX kernel.
uint32_t* bf16_scratch(size_t words) {
  thread_local uint32_t* buf = nullptr;
  thread_local size_t cap = 0;
  if (cap < words) {
    std::free(buf);
    buf = static_cast<uint32_t*>(std::aligned_alloc(64, (words * 4 + 63) / 64 * 64));
    cap = words;
  }
  return buf;
}

}  // namespace chunkattn_cpu
#endif
