// The attend kernel for bf16 KV and bf16 query on AMX (Sapphire Rapids and later): the products
// of attend_avx512_bf16.cpp on tile registers. Used only where the CPU has AMX-BF16 and the OS
// grants its use (amx_usable).
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tpp_attend.h"

#define CHUNKATTN_ISA_AVX512
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
namespace chunkattn_cpu {
namespace {
#include "vec_isa.h"
#include "attend_impl.h"
#include "bf16_pair_tiles.h"

// S = Q.K^T and P.V as 16 x 16 fp32 tile products, each TDPBF16PS doing 16 x 16 x 32 MACs. The
// pair layouts of bf16_pair_tiles.h are already AMX's: a kp slice of 16 pairs x 16 tokens is the
// B tile of S = Q.K^T, a vp slice of 16 token pairs x 16 dims the B tile of P.V, and query / p
// rows (bf16, natural order) are A tiles.
//
// Loop order: key tiles of 64 tokens outer (packed once, 32 KB at D = 128: stays in L1 while all
// rows pass; CPU_ATTN's AMX-layout cache holds them as they are and is read in place), rows in blocks of 16 inner, with every row's o in a dense scratch (L2) rather than
// the strided workspace. Tiles: tmm0-3 accumulators, tmm4 A, tmm5 B. Softmax stays AVX-512 fp32.
constexpr int kAmxMinRows = 8;  // below this, packing K and V for tiles costs more than vdpbf16ps saves

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

template <int D>
void attend_amx(const AttendArgs& a) {
  // K and V already in AMX's B-tile layout (CPU_ATTN's cache) cost no packing: tiles pay off
  // from one row.
  if (a.num_rows < (a.k.amx_packed ? 1 : kAmxMinRows)) return attend_avx512_bf16(D)(a);
  const int R = a.num_rows, RP = (R + 15) / 16 * 16;
  // Scratch: kp [D/2][64], vp [32][D], o [RP][D] fp32, q [RP][D] bf16 (zero padding rows).
  uint32_t* kp = bf16_scratch(size_t(kKeyTile) * D + size_t(RP) * D + size_t(RP) * D / 2);
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
  const int seen = first_seen_key(a);
  for (int t0 = first_visible_key(a, kKeyTile); t0 < a.num_tokens; t0 += kKeyTile) {
    const int n = imin(kKeyTile, a.num_tokens - t0);
    for (int i = 0; i < kKeyTile; i += kTile) pack_tile<D>(a, t0, i, imin(kTile, n - i), seen, kp, kKeyTile, vp);
    const PairTile pt = tile_at<D>(a, t0, 0, seen, kp, kKeyTile, vp);
    const int kstride = int(pt.kps * 4), vstride = int(pt.vps * 4);
    if (t0 + kKeyTile < a.num_tokens)
      prefetch_tokens<D>(a, t0 + kKeyTile, imin(kKeyTile, a.num_tokens - t0 - kKeyTile));
    for (int r0 = 0; r0 < R; r0 += 16) {
      const int rt = imin(16, R - r0);
      // S[16][64] = Q K^T
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int k = 0; k < D / 32; ++k) {
        _tile_loadd(4, q + size_t(r0) * D + k * 32, D * 2);
        const int64_t kb = int64_t(k) * 16 * pt.kps;
        _tile_loadd(5, pt.k[0] + kb, kstride); _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, pt.k[1] + kb, kstride); _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, pt.k[2] + kb, kstride); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, pt.k[3] + kb, kstride); _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, s, kKeyTile * 4); _tile_stored(1, s + 16, kKeyTile * 4);
      _tile_stored(2, s + 32, kKeyTile * 4); _tile_stored(3, s + 48, kKeyTile * 4);
      softmax_rows(a, r0, t0, s, pb, m + r0, l + r0, alpha, rt, n);
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
          const uint32_t* vb = pt.v[k] + (c0 / 16) * pt.vds[k];
          const int64_t vd = pt.vds[k];
          _tile_loadd(5, vb, vstride); _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, vb + vd, vstride); _tile_dpbf16ps(1, 4, 5);
          _tile_loadd(5, vb + 2 * vd, vstride); _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, vb + 3 * vd, vstride); _tile_dpbf16ps(3, 4, 5);
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
#endif
