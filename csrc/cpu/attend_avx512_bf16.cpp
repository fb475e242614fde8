// The attend kernel for bf16 KV and bf16 query on AVX512_BF16 (Cooper Lake, Sapphire Rapids,
// Zen 4 and later): both products run on vdpbf16ps (32 bf16 MACs per instruction, fp32
// accumulation), twice the fp32-FMA rate. Softmax stays fp32; only p is rounded to bf16 for P.V,
// as in every bf16 flash-attention kernel (l is summed from the unrounded p).
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tpp_attend.h"

#if defined(__x86_64__)
#define CHUNKATTN_ISA_AVX512
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace chunkattn_cpu {
namespace {
#include "vec_isa.h"
#include "attend_impl.h"

// vdpbf16ps sums one pair of bf16 per 32-bit lane, so tiles are packed as pairs:
//   kp[D/2][ks]:      lane t of row p = (k[t][2p], k[t][2p+1])   pairs along the head dim
//   vp[n/2][D]:       lane d of row u = (v[2u][d], v[2u+1][d])   pairs along the tokens
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
void pack_tile_bf16(const AttendArgs& a, int t0, int n, uint32_t* kp, int ks, uint32_t* vp) {
  const __m512i idx = _mm512_load_si512(kInterleave);
  const uint16_t* kd = static_cast<const uint16_t*>(a.k.data);
  const uint16_t* vd = static_cast<const uint16_t*>(a.v.data);
  const bool k_transposed = a.k.dim_stride != 1;
  for (int i = 0; i < kTile; i += 16) {
    if (i >= n) {  // whole run past the end: zeros (cache memory there may hold NaN)
      for (int p = 0; p < D / 2; ++p) _mm512_storeu_si512(kp + p * ks + i, _mm512_setzero_si512());
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
        _mm512_storeu_si512(kp + p * ks + i, interleave16(idx, k0, k1));
      }
    } else {  // flash layout: a (2p, 2p+1) pair is one 32-bit word of the token's row
      for (int j = 0; j < 16; ++j) {
        const uint16_t* src = kb + j * a.k.token_stride;
        for (int p = 0; p < D / 2; ++p) {
          uint32_t w = 0;
          if (j < valid) __builtin_memcpy(&w, src + 2 * p, 4);
          kp[p * ks + i + j] = w;
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

// Prefetch KV tokens [t0, t0 + n) into L2 while the current tile is computed: paged blocks sit in
// random order, so the hardware prefetchers lose the stream at every block boundary.
template <int D>
inline void prefetch_tokens(const AttendArgs& a, int t0, int n) {
  const uint16_t* kd = static_cast<const uint16_t*>(a.k.data);
  const uint16_t* vd = static_cast<const uint16_t*>(a.v.data);
  const bool k_transposed = a.k.dim_stride != 1;
  for (int i = 0; i < n; i += 16) {  // 16-token runs never cross a block (block_size % 16 == 0)
    const int tok = t0 + i, off = tok % a.block_size;
    const int64_t blk = a.block_ids[tok / a.block_size];
    const uint16_t* kb = kd + blk * a.k.block_stride + a.kv_head * a.k.head_stride + off * a.k.token_stride;
    const uint16_t* vb = vd + blk * a.v.block_stride + a.kv_head * a.v.head_stride + off * a.v.token_stride;
    if (k_transposed) {
      if (off % 32 == 0 || a.block_size == 16)  // a 64-byte line holds 32 tokens of one dim
        for (int d = 0; d < D; ++d) _mm_prefetch(reinterpret_cast<const char*>(kb + d * a.k.dim_stride), _MM_HINT_T1);
    } else {
      for (int j = 0; j < 16; ++j)
        for (int c = 0; c < D; c += 32) _mm_prefetch(reinterpret_cast<const char*>(kb + j * a.k.token_stride + c), _MM_HINT_T1);
    }
    for (int j = 0; j < 16; ++j)
      for (int c = 0; c < D; c += 32) _mm_prefetch(reinterpret_cast<const char*>(vb + j * a.v.token_stride + c), _MM_HINT_T1);
  }
}

// ---- the kernel: GEMM-shaped, for many rows (chunk-first) and few (sequence-first) alike.
//
// The KV run is walked in chunks of up to kChunk tokens, packed once per chunk into the VNNI pair
// layouts above (kp row stride = chunk length). Rows go in blocks of kRowBlock whose o, m, l live
// in a dense local scratch (in L1) for the whole chunk, and each block streams over the packed
// chunk (from L2) in key tiles of kKeyTile: S = Q.K^T by a 4 rows x 64 keys register block
// (16 zmm accumulators; each K vector load feeds 4 rows, each q broadcast 4 key vectors), online
// softmax per row in fp32, then O = alpha * O + P.V by a 4 rows x 64 dims register block. The
// output state in the workspace is strided by sequence (16 KB apart, L1 set conflicts), so it is
// touched only once per (row block, chunk).
constexpr int kKeyTile = 64;
constexpr int kChunk = 512;
constexpr int kRowBlock = 32;

// s[r][0:64] = q[r] . k[t] for RT rows; q as [RT][D/2] pairs, kp with row stride ks.
template <int D, int RT>
inline void qk_block(const uint32_t* q, const uint32_t* kp, int ks, float* s) {
  constexpr int NV = kKeyTile / 16;
  __m512 acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh k[NV];
    for (int j = 0; j < NV; ++j) k[j] = as_bh(_mm512_loadu_si512(kp + p * ks + j * 16));
    for (int r = 0; r < RT; ++r) {
      __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * (D / 2) + p])));
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qb, k[j]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(s + r * kKeyTile + j * 16, acc[r][j]);
}

template <int D, int RT>
inline void qk_rows(const uint32_t* q, const uint32_t* kp, int ks, float* s, int rows) {
  for (; rows >= RT; rows -= RT, q += RT * (D / 2), s += RT * kKeyTile) qk_block<D, RT>(q, kp, ks, s);
  if constexpr (RT > 1) {
    if (rows > 0) qk_rows<D, RT / 2>(q, kp, ks, s, rows);
  }
}

// One online-softmax step per row over a key tile of n valid keys (n >= 1): s (raw dot products)
// becomes p = exp(scale * s - m_new), stored to pb as bf16 pairs for P.V (padding keys give 0);
// alpha = exp(m_old - m_new) rescales o; l sums the unrounded p.
inline void softmax_rows(float* s, uint32_t* pb, float* m, float* l, float* alpha, int rows, int n,
                         float scale_f) {
  constexpr int NV = kKeyTile / 16;
  const __m512 scale = _mm512_set1_ps(scale_f);
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
  for (int r = 0; r < rows; ++r) {
    const float* row = s + r * kKeyTile;
    __m512 x[NV];
    __m512 mx = ninf;
    for (int j = 0; j < NV; ++j) {
      x[j] = _mm512_mul_ps(_mm512_loadu_ps(row + j * 16), scale);
      const int valid = n - j * 16;  // padding keys -> -inf -> p = 0
      if (valid < 16) x[j] = valid <= 0 ? ninf : _mm512_mask_mov_ps(ninf, (__mmask16)((1u << valid) - 1), x[j]);
      mx = _mm512_max_ps(mx, x[j]);
    }
    const float m_tile = _mm512_reduce_max_ps(mx);
    const float m_new = m_tile > m[r] ? m_tile : m[r];
    alpha[r] = expf(m[r] - m_new);  // first tile: exp(-inf) = 0 wipes the zeroed o
    const __m512 mn = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < NV; j += 2) {
      __m512 p0 = IsaAvx512::exp(_mm512_sub_ps(x[j], mn));
      __m512 p1 = IsaAvx512::exp(_mm512_sub_ps(x[j + 1], mn));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(pb + r * (kKeyTile / 2) + j * 8, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    m[r] = m_new;
  }
}

// o[r] = alpha[r] * o[r] + p[r] . V for RP rows; p as [RP][32] pairs, vp the tile's [32][D] pairs,
// o dense [RP][D].
template <int D, int RP>
inline void pv_block(const uint32_t* p, const float* alpha, const uint32_t* vp, float* o) {
  constexpr int NV = D / 16;
  constexpr int DB = NV < 4 ? NV : 4;  // RP x DB = 16 accumulators
  for (int c0 = 0; c0 < NV; c0 += DB) {
    __m512 acc[RP][DB];
    for (int r = 0; r < RP; ++r) {
      __m512 al = _mm512_set1_ps(alpha[r]);
      for (int j = 0; j < DB; ++j) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + (c0 + j) * 16), al);
    }
    for (int u = 0; u < kKeyTile / 2; ++u) {
      __m512bh v[DB];
      for (int j = 0; j < DB; ++j) v[j] = as_bh(_mm512_loadu_si512(vp + u * D + (c0 + j) * 16));
      for (int r = 0; r < RP; ++r) {
        __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * (kKeyTile / 2) + u])));
        for (int j = 0; j < DB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pb, v[j]);
      }
    }
    for (int r = 0; r < RP; ++r)
      for (int j = 0; j < DB; ++j) _mm512_storeu_ps(o + r * D + (c0 + j) * 16, acc[r][j]);
  }
}

template <int D, int RP>
inline void pv_rows(const uint32_t* p, const float* alpha, const uint32_t* vp, float* o, int rows) {
  for (; rows >= RP; rows -= RP, p += RP * (kKeyTile / 2), alpha += RP, o += RP * D)
    pv_block<D, RP>(p, alpha, vp, o);
  if constexpr (RP > 1) {
    if (rows > 0) pv_rows<D, RP / 2>(p, alpha, vp, o, rows);
  }
}

// Per-thread packed chunk, grown on demand (too big for a worker thread's stack at D = 256).
inline uint32_t* chunk_buffer(size_t words) {
  thread_local uint32_t* buf = nullptr;
  thread_local size_t cap = 0;
  if (cap < words) {
    std::free(buf);
    buf = static_cast<uint32_t*>(std::aligned_alloc(64, (words * 4 + 63) / 64 * 64));
    cap = words;
  }
  return buf;
}

template <int D>
void attend_bf16(const AttendArgs& a) {
  // Few rows (sequence-first): one key tile per chunk, so the packed tile stays in L1.
  const int chunk = a.num_rows > kRowBlock ? kChunk : kKeyTile;
  uint32_t* kp = chunk_buffer(size_t(chunk) * D);  // [D/2][chunk] then [chunk/2][D]
  uint32_t* vp = kp + size_t(chunk) * D / 2;
  alignas(64) float o[kRowBlock * D];
  alignas(64) float s[kRowBlock * kKeyTile];
  alignas(64) uint32_t pb[kRowBlock * kKeyTile / 2];
  float m[kRowBlock], l[kRowBlock], alpha[kRowBlock];
  const uint32_t* q = static_cast<const uint32_t*>(a.q);
  init_states(a, D);
  for (int c0 = 0; c0 < a.num_tokens; c0 += chunk) {
    const int cn = imin(chunk, a.num_tokens - c0);
    const int padded = (cn + kKeyTile - 1) / kKeyTile * kKeyTile;
    for (int i = 0; i < padded; i += kTile)
      pack_tile_bf16<D>(a, c0 + i, imin(kTile, cn - i), kp + i, chunk, vp + i / 2 * D);
    if (c0 + chunk < a.num_tokens) prefetch_tokens<D>(a, c0 + chunk, imin(chunk, a.num_tokens - c0 - chunk));
    for (int r0 = 0; r0 < a.num_rows; r0 += kRowBlock) {
      const int rt = imin(kRowBlock, a.num_rows - r0);
      for (int r = 0; r < rt; ++r) {
        std::memcpy(o + r * D, o_row(a, r0 + r, D), D * 4);
        m[r] = *m_row(a, r0 + r);
        l[r] = *l_row(a, r0 + r);
      }
      for (int t = 0; t < cn; t += kKeyTile) {
        qk_rows<D, 4>(q + r0 * (D / 2), kp + t, chunk, s, rt);
        softmax_rows(s, pb, m, l, alpha, rt, imin(kKeyTile, cn - t), a.scale);
        pv_rows<D, 4>(pb, alpha, vp + t / 2 * D, o, rt);
      }
      for (int r = 0; r < rt; ++r) {
        std::memcpy(o_row(a, r0 + r, D), o + r * D, D * 4);
        *m_row(a, r0 + r) = m[r];
        *l_row(a, r0 + r) = l[r];
      }
    }
  }
}

// ---- AMX (Sapphire Rapids and later): the same two products as 16 x 16 fp32 tile products,
// each TDPBF16PS doing 16 x 16 x 32 MACs. The packed layouts above are already AMX's: a kp slice
// of 16 pairs x 16 tokens is the B tile of S = Q.K^T, a vp slice of 16 token pairs x 16 dims the
// B tile of P.V, and query / p rows (bf16, natural order) are A tiles.
//
// Loop order: key tiles of 64 tokens outer (packed once, 32 KB at D = 128: stays in L1 while all
// rows pass), rows in blocks of 16 inner, with every row's o in a dense scratch (L2) rather than
// the strided workspace. Tiles: tmm0-3 accumulators, tmm4 A, tmm5 B. Softmax stays AVX-512 fp32.
#define CHUNKATTN_AMX_FN \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")))

constexpr int kAmxMinRows = 8;  // below this a 16-row tile is mostly padding: use vdpbf16ps

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

template <int D>
CHUNKATTN_AMX_FN void attend_amx(const AttendArgs& a) {
  if (a.num_rows < kAmxMinRows) return attend_bf16<D>(a);
  const int R = a.num_rows, RP = (R + 15) / 16 * 16;
  // Scratch: kp [D/2][64], vp [32][D], o [RP][D] fp32, q [RP][D] bf16 (zero padding rows).
  uint32_t* kp = chunk_buffer(size_t(kKeyTile) * D + size_t(RP) * D + size_t(RP) * D / 2);
  uint32_t* vp = kp + kKeyTile * D / 2;
  float* o = reinterpret_cast<float*>(vp + kKeyTile * D / 2);
  uint16_t* q = reinterpret_cast<uint16_t*>(o + size_t(RP) * D);
  std::memcpy(q, a.q, size_t(R) * D * 2);
  std::memset(q + size_t(R) * D, 0, size_t(RP - R) * D * 2);
  std::memset(o, 0, size_t(RP) * D * 4);
  std::vector<float> ml(2 * size_t(RP));
  float* m = ml.data();
  float* l = m + RP;
  for (int r = 0; r < RP; ++r) m[r] = -__builtin_inff(), l[r] = 0.f;
  alignas(64) float s[16 * kKeyTile];
  alignas(64) uint32_t pb[16 * kKeyTile / 2] = {};  // rows past R stay 0: padding adds nothing
  float alpha[16];

  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 6; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  for (int t0 = 0; t0 < a.num_tokens; t0 += kKeyTile) {
    const int n = imin(kKeyTile, a.num_tokens - t0);
    for (int i = 0; i < kKeyTile; i += kTile)
      pack_tile_bf16<D>(a, t0 + i, imin(kTile, n - i), kp + i, kKeyTile, vp + i / 2 * D);
    if (t0 + kKeyTile < a.num_tokens)
      prefetch_tokens<D>(a, t0 + kKeyTile, imin(kKeyTile, a.num_tokens - t0 - kKeyTile));
    for (int r0 = 0; r0 < R; r0 += 16) {
      const int rt = imin(16, R - r0);
      // S[16][64] = Q K^T
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int k = 0; k < D / 32; ++k) {
        _tile_loadd(4, q + size_t(r0) * D + k * 32, D * 2);
        const uint32_t* kb = kp + k * 16 * kKeyTile;
        _tile_loadd(5, kb, kKeyTile * 4); _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, kb + 16, kKeyTile * 4); _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, kb + 32, kKeyTile * 4); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, kb + 48, kKeyTile * 4); _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, s, kKeyTile * 4); _tile_stored(1, s + 16, kKeyTile * 4);
      _tile_stored(2, s + 32, kKeyTile * 4); _tile_stored(3, s + 48, kKeyTile * 4);
      softmax_rows(s, pb, m + r0, l + r0, alpha, rt, n, a.scale);
      // O = alpha O + P V, 64 dims (4 accumulator tiles) at a time
      float* ob = o + size_t(r0) * D;
      for (int r = 0; r < rt; ++r) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < D; c += 16) _mm512_storeu_ps(ob + r * D + c, _mm512_mul_ps(_mm512_loadu_ps(ob + r * D + c), al));
      }
      for (int c0 = 0; c0 < D; c0 += 64) {
        _tile_loadd(0, ob + c0, D * 4); _tile_loadd(1, ob + c0 + 16, D * 4);
        _tile_loadd(2, ob + c0 + 32, D * 4); _tile_loadd(3, ob + c0 + 48, D * 4);
        for (int k = 0; k < kKeyTile / 32; ++k) {
          _tile_loadd(4, pb + k * 16, kKeyTile * 2);
          const uint32_t* vb = vp + k * 16 * D + c0;
          _tile_loadd(5, vb, D * 4); _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, vb + 16, D * 4); _tile_dpbf16ps(1, 4, 5);
          _tile_loadd(5, vb + 32, D * 4); _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, vb + 48, D * 4); _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, ob + c0, D * 4); _tile_stored(1, ob + c0 + 16, D * 4);
        _tile_stored(2, ob + c0 + 32, D * 4); _tile_stored(3, ob + c0 + 48, D * 4);
      }
    }
  }
  _tile_release();
  for (int r = 0; r < R; ++r) {
    std::memcpy(o_row(a, r, D), o + size_t(r) * D, D * 4);
    *m_row(a, r) = m[r];
    *l_row(a, r) = l[r];
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

// CPUID says AMX-TILE and AMX-BF16, and Linux lets this process use the tile data state
// (ARCH_REQ_XCOMP_PERM; asked once, the grant is process-wide).
bool amx_usable() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

AttendFn attend_amx(int head_size) {
  if (!amx_usable()) return nullptr;
  switch (head_size) {
    case 64: return &attend_amx<64>;
    case 128: return &attend_amx<128>;
    case 256: return &attend_amx<256>;
    default: return nullptr;
  }
}

}  // namespace chunkattn_cpu
#else
namespace chunkattn_cpu {
AttendFn attend_avx512_bf16(int) { return nullptr; }
AttendFn attend_amx(int) { return nullptr; }
}  // namespace chunkattn_cpu
#endif
