// The attend kernel for bf16 KV and bf16 query on AVX512_BF16 (Cooper Lake, Sapphire Rapids,
// Zen 4 and later): both products run on vdpbf16ps (32 bf16 MACs per instruction, fp32
// accumulation), twice the fp32-FMA rate. Softmax stays fp32; only p is rounded to bf16 for P.V,
// as in every bf16 flash-attention kernel (l is summed from the unrounded p).
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

#include "tpp_attend.h"

#if defined(__x86_64__)
#define CHUNKATTN_ISA_AVX512
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace chunkattn_cpu {
namespace {
#include "vec_isa.h"
#include "attend_impl.h"

// vdpbf16ps sums one pair of bf16 per 32-bit lane, so tiles are packed as pairs:
//   kp[D/2][kTile]:   lane t of row p = (k[t][2p], k[t][2p+1])   pairs along the head dim
//   vp[kTile/2][D]:   lane d of row u = (v[2u][d], v[2u+1][d])   pairs along the tokens
// and a query (or p) pair is broadcast to all lanes.
alignas(64) const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                              21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                              11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// (a0 b0 a1 b1 ... a15 b15) from two rows of 16 bf16.
inline __m512i interleave16(__m512i idx, __m256i a, __m256i b) {
  return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Tokens are packed in runs of 16: block_size % 16 == 0 and t0 % 32 == 0 keep a run in one block.
template <int D>
void pack_tile_bf16(const AttendArgs& a, int t0, int n, uint32_t* kp, uint32_t* vp) {
  const __m512i idx = _mm512_load_si512(kInterleave);
  const uint16_t* kd = static_cast<const uint16_t*>(a.k.data);
  const uint16_t* vd = static_cast<const uint16_t*>(a.v.data);
  const bool k_transposed = a.k.dim_stride != 1;
  for (int i = 0; i < kTile; i += 16) {
    if (i >= n) {  // whole run past the end: zeros (cache memory there may hold NaN)
      for (int p = 0; p < D / 2; ++p) _mm512_storeu_si512(kp + p * kTile + i, _mm512_setzero_si512());
      for (int u = i / 2; u < (i + 16) / 2; ++u)
        for (int c = 0; c < D; c += 16) _mm512_storeu_si512(vp + u * D + c, _mm512_setzero_si512());
      continue;
    }
    const int valid = imin(16, n - i), tok = t0 + i;
    const int64_t blk = a.block_ids[tok / a.block_size];
    const int off = tok % a.block_size;
    const uint16_t* kb = kd + blk * a.k.block_stride + a.kv_head * a.k.head_stride + off * a.k.token_stride;
    const uint16_t* vb = vd + blk * a.v.block_stride + a.kv_head * a.v.head_stride + off * a.v.token_stride;
    if (k_transposed) {
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      for (int p = 0; p < D / 2; ++p) {
        __m256i k0 = _mm256_maskz_loadu_epi16(mask, kb + (2 * p) * a.k.dim_stride);
        __m256i k1 = _mm256_maskz_loadu_epi16(mask, kb + (2 * p + 1) * a.k.dim_stride);
        _mm512_storeu_si512(kp + p * kTile + i, interleave16(idx, k0, k1));
      }
    } else {  // flash layout: a (2p, 2p+1) pair is one 32-bit word of the token's row
      for (int j = 0; j < 16; ++j) {
        const uint16_t* src = kb + j * a.k.token_stride;
        for (int p = 0; p < D / 2; ++p) {
          uint32_t w = 0;
          if (j < valid) __builtin_memcpy(&w, src + 2 * p, 4);
          kp[p * kTile + i + j] = w;
        }
      }
    }
    for (int j = 0; j < 16; j += 2) {
      const uint16_t* v0 = vb + j * a.v.token_stride;
      const uint16_t* v1 = v0 + a.v.token_stride;
      uint32_t* dst = vp + (i + j) / 2 * D;
      for (int c = 0; c < D; c += 16) {
        __m256i x0 = j < valid ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c))
                               : _mm256_setzero_si256();
        __m256i x1 = j + 1 < valid ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c))
                                   : _mm256_setzero_si256();
        _mm512_storeu_si512(dst + c, interleave16(idx, x0, x1));
      }
    }
  }
}

// s[r][0:kTile] = q[r] . k[t] for RT rows; q as [RT][D/2] pairs.
template <int D, int RT>
inline void qk_block_bf16(const uint32_t* q, const uint32_t* kp, float* s) {
  __m512 acc[RT][2];
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh k0 = as_bh(_mm512_loadu_si512(kp + p * kTile));
    __m512bh k1 = as_bh(_mm512_loadu_si512(kp + p * kTile + 16));
    for (int r = 0; r < RT; ++r) {
      __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * (D / 2) + p])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
    }
  }
  for (int r = 0; r < RT; ++r) {
    _mm512_storeu_ps(s + r * kTile, acc[r][0]);
    _mm512_storeu_ps(s + r * kTile + 16, acc[r][1]);
  }
}

template <int D, int RT>
inline void qk_rows_bf16(const uint32_t* q, const uint32_t* kp, float* s, int rows) {
  for (; rows >= RT; rows -= RT, q += RT * (D / 2), s += RT * kTile) qk_block_bf16<D, RT>(q, kp, s);
  if constexpr (RT > 1) {
    if (rows > 0) qk_rows_bf16<D, RT / 2>(q, kp, s, rows);
  }
}

// o[r] = alpha[r] * o[r] + p[r] . V for RP rows; p as [RP][kTile/2] pairs.
template <int D, int RP>
inline void pv_block_bf16(const uint32_t* p, const float* alpha, const uint32_t* vp, float* const* o) {
  constexpr int NV = D / 16;
  constexpr int DB = NV < 4 ? NV : 4;  // RP x DB = 16 accumulators
  for (int c0 = 0; c0 < NV; c0 += DB) {
    __m512 acc[RP][DB];
    for (int r = 0; r < RP; ++r) {
      __m512 al = _mm512_set1_ps(alpha[r]);
      for (int j = 0; j < DB; ++j) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o[r] + (c0 + j) * 16), al);
    }
    for (int u = 0; u < kTile / 2; ++u) {
      __m512bh v[DB];
      for (int j = 0; j < DB; ++j) v[j] = as_bh(_mm512_loadu_si512(vp + u * D + (c0 + j) * 16));
      for (int r = 0; r < RP; ++r) {
        __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * (kTile / 2) + u])));
        for (int j = 0; j < DB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pb, v[j]);
      }
    }
    for (int r = 0; r < RP; ++r)
      for (int j = 0; j < DB; ++j) _mm512_storeu_ps(o[r] + (c0 + j) * 16, acc[r][j]);
  }
}

template <int D, int RP>
inline void pv_rows_bf16(const uint32_t* p, const float* alpha, const uint32_t* vp, float* const* o,
                         int rows) {
  for (; rows >= RP; rows -= RP, p += RP * (kTile / 2), alpha += RP, o += RP)
    pv_block_bf16<D, RP>(p, alpha, vp, o);
  if constexpr (RP > 1) {
    if (rows > 0) pv_rows_bf16<D, RP / 2>(p, alpha, vp, o, rows);
  }
}

template <int D>
void attend_bf16(const AttendArgs& a) {
  alignas(64) uint32_t kp[D / 2 * kTile];
  alignas(64) uint32_t vp[kTile / 2 * D];
  alignas(64) float s[kRowTile * kTile];
  alignas(64) uint32_t pb[kRowTile * kTile / 2];
  float alpha[kRowTile];
  float* o[kRowTile];
  const uint32_t* q = static_cast<const uint32_t*>(a.q);
  init_states(a, D);
  for (int t0 = 0; t0 < a.num_tokens; t0 += kTile) {
    const int n = imin(kTile, a.num_tokens - t0);
    pack_tile_bf16<D>(a, t0, n, kp, vp);
    for (int r0 = 0; r0 < a.num_rows; r0 += kRowTile) {
      const int rt = imin(kRowTile, a.num_rows - r0);
      qk_rows_bf16<D, 8>(q + r0 * (D / 2), kp, s, rt);
      softmax_tile<IsaAvx512>(a, r0, rt, n, s, alpha);
      for (int r = 0; r < rt; ++r) {
        __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * kTile + 16), _mm512_loadu_ps(s + r * kTile));
        _mm512_storeu_si512(pb + r * (kTile / 2), (__m512i)p);
        o[r] = o_row(a, r0 + r, D);
      }
      pv_rows_bf16<D, 4>(pb, alpha, vp, o, rt);
    }
  }
}

}  // namespace

AttendFn attend_avx512_bf16(int head_size) {
  switch (head_size) {
    case 64: return &attend_bf16<64>;
    case 128: return &attend_bf16<128>;
    case 256: return &attend_bf16<256>;
    default: return nullptr;
  }
}

}  // namespace chunkattn_cpu
#else
namespace chunkattn_cpu {
AttendFn attend_avx512_bf16(int) { return nullptr; }
}  // namespace chunkattn_cpu
#endif
