// The bf16 tiles of the AVX512_BF16 and AMX attend kernels (attend_avx512_bf16.cpp,
// attend_amx.cpp): KV tokens packed into the pair layout both instructions read, their prefetch,
// and the fp32 online-softmax step that writes p in that layout. Include after vec_isa.h and
// attend_impl.h, inside the anonymous namespace (see vec_isa.h).

constexpr int kKeyTile = 64;  // keys of one score tile (S = Q.K^T, then P.V)

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
// Tokens [0, lo) and [n, kTile) of the tile are packed as zeros, unread: before lo no row of the
// call sees a key (a window's edge), past n the run has ended.
template <int D>
void pack_tile_bf16(const AttendArgs& a, int t0, int n, uint32_t* kp, int ks, uint32_t* vp, int lo) {
  const __m512i idx = _mm512_load_si512(kInterleave);
  const uint16_t* kd = static_cast<const uint16_t*>(a.k.data);
  const uint16_t* vd = static_cast<const uint16_t*>(a.v.data);
  const bool k_transposed = a.k.dim_stride != 1;
  for (int i = 0; i < kTile; i += 16) {
    const int low = imin(imax(lo - i, 0), 16);
    if (i >= n || low >= imin(16, n - i)) {  // no token of the run is read: zeros (cache memory
                                            // there may hold NaN)
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
      const __mmask16 mask = static_cast<__mmask16>(((1u << valid) - 1) & ~((1u << low) - 1));
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
          if (j >= low && j < valid) __builtin_memcpy(&w, src + 2 * p, 4);
          kp[p * ks + i + j] = w;
        }
      }
    }
    for (int j = 0; j < 16; j += 2) {
      const uint16_t* v0 = vb + j * a.v.token_stride;
      const uint16_t* v1 = v0 + a.v.token_stride;
      uint32_t* dst = vp + (i + j) / 2 * D;
      for (int c = 0; c < D; c += 16) {
        __m256i x0 = j >= low && j < valid ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c))
                                           : _mm256_setzero_si256();
        __m256i x1 = j + 1 >= low && j + 1 < valid
                         ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c))
                         : _mm256_setzero_si256();
        _mm512_storeu_si512(dst + c, interleave16(idx, x0, x1));
      }
    }
  }
}

// Where a key tile's products read their pair tiles: the 16-key run j at k[j] (dim pair p at
// k[j] + p * kps) and the 32-key half h at v[h] (token pair u, dims 16c.. at
// v[h] + u * vps + c * vds[h]). Either the kernel's packed scratch or CPU_ATTN's AMX-layout cache
// itself, whose slabs already hold these tiles.
struct PairTile {
  const uint32_t* k[4];
  int64_t kps;
  const uint32_t* v[2];
  int64_t vps, vds[2];
};

// The tile at key t of a scratch packed by pack_tile_bf16 (kp row stride ks).
template <int D>
inline PairTile packed_tile(const uint32_t* kp, const uint32_t* vp, int t, int ks) {
  PairTile pt;
  for (int j = 0; j < 4; ++j) pt.k[j] = kp + t + 16 * j;
  pt.kps = ks;
  for (int h = 0; h < 2; ++h) pt.v[h] = vp + size_t(t / 2 + 16 * h) * D, pt.vds[h] = 16;
  pt.vps = D;
  return pt;
}

// CPU_ATTN's AMX layout (bf16, block_size % 32 == 0), per (block, kv head) slab in 32-bit words:
//   K: 16-token groups of [D/2][16] pairs: (k[t][2p], k[t][2p+1]) at (t/16) * 8D + p * 16 + t % 16
//   V: 16-dim groups of [block_size/2][16] pairs: (v[2u][d], v[2u+1][d]) at
//      (d/16) * 8 * block_size + u * 16 + d % 16
// A 32-key half is read in place when every key of it is in the run and seen (cache slots past
// the run or before every row's window may hold NaN); else it is packed, masked, into scratch of
// the same shape (K runs 8D words apart, V groups 256 words apart).
inline bool amx_in_place(const AttendArgs& a, int t, int seen) {
  return t >= seen && t + kTile <= a.num_tokens;
}

inline const uint32_t* amx_slab(const KvCacheView& c, const AttendArgs& a, int t) {
  const int64_t blk = a.block_ids[t / a.block_size];
  return static_cast<const uint32_t*>(c.data) + (blk * c.block_stride + a.kv_head * c.head_stride) / 2;
}

template <int D>
inline const uint32_t* amx_k_run(const AttendArgs& a, int t) {  // t % 16 == 0
  return amx_slab(a.k, a, t) + (t % a.block_size) / 16 * (8 * D);
}

inline const uint32_t* amx_v_pairs(const AttendArgs& a, int t) {  // t % 2 == 0
  return amx_slab(a.v, a, t) + (t % a.block_size) / 2 * 16;
}

// The tile at key c0 + t; halves that are not in place were packed at kp / vp + their offset
// from c0.
template <int D>
inline PairTile amx_tile(const AttendArgs& a, int c0, int t, int seen, const uint32_t* kp, const uint32_t* vp) {
  PairTile pt;
  pt.kps = 16;
  pt.vps = 16;
  for (int h = 0; h < 2; ++h) {
    const int i = t + 32 * h;
    const bool in_place = amx_in_place(a, c0 + i, seen);
    pt.v[h] = in_place ? amx_v_pairs(a, c0 + i) : vp + size_t(i / 32) * 16 * D;
    pt.vds[h] = in_place ? 8 * int64_t(a.block_size) : 256;
    for (int r = 0; r < 2; ++r)
      pt.k[2 * h + r] = in_place ? amx_k_run<D>(a, c0 + i + 16 * r) : kp + size_t(i / 16 + r) * 8 * D;
  }
  return pt;
}

// Packs the AMX-layout half at key t (t % 32 == 0) into kdst (two runs) and vdst: keys [lo, n)
// from t are copied, the others are zeros and never read.
template <int D>
void pack_amx_half(const AttendArgs& a, int t, int n, int lo, uint32_t* kdst, uint32_t* vdst) {
  auto valid = [&](int j) { return j >= lo && j < n; };
  const bool any = imax(lo, 0) < imin(n, kTile);
  const uint32_t* kb = any ? amx_k_run<D>(a, t) : nullptr;
  for (int r = 0; r < 2; ++r) {
    uint32_t mask = 0;
    for (int j = 0; j < 16; ++j) mask |= uint32_t(valid(16 * r + j)) << j;
    for (int p = 0; p < D / 2; ++p)
      _mm512_storeu_si512(kdst + r * 8 * D + p * 16,
                          mask ? _mm512_maskz_loadu_epi32((__mmask16)mask, kb + r * 8 * D + p * 16)
                               : _mm512_setzero_si512());
  }
  const uint32_t* vb = any ? amx_v_pairs(a, t) : nullptr;
  for (int u = 0; u < 16; ++u) {
    const __mmask32 mask = (valid(2 * u) ? 0x55555555u : 0u) | (valid(2 * u + 1) ? 0xAAAAAAAAu : 0u);
    for (int g = 0; g < D / 16; ++g)
      _mm512_storeu_si512(vdst + g * 256 + u * 16,
                          mask ? _mm512_maskz_loadu_epi16(mask, vb + int64_t(g) * 8 * a.block_size + u * 16)
                               : _mm512_setzero_si512());
  }
}

// Packs what a tile at key c0 + t needs: halves not read in place, at their offset from c0.
template <int D>
inline void pack_tile(const AttendArgs& a, int c0, int t, int n, int seen, uint32_t* kp, int ks, uint32_t* vp) {
  if (!a.k.amx_packed) return pack_tile_bf16<D>(a, c0 + t, n, kp + t, ks, vp + t / 2 * D, seen - (c0 + t));
  if (!amx_in_place(a, c0 + t, seen))
    pack_amx_half<D>(a, c0 + t, n, seen - (c0 + t), kp + size_t(t / 16) * 8 * D, vp + size_t(t / 32) * 16 * D);
}

template <int D>
inline PairTile tile_at(const AttendArgs& a, int c0, int t, int seen, const uint32_t* kp, int ks, const uint32_t* vp) {
  return a.k.amx_packed ? amx_tile<D>(a, c0, t, seen, kp, vp) : packed_tile<D>(kp, vp, t, ks);
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
    if (a.k.amx_packed) {  // a K run is 32D contiguous bytes, V 512 bytes per 16-dim group
      const char* kr = reinterpret_cast<const char*>(amx_k_run<D>(a, tok));
      for (int c = 0; c < 32 * D; c += 64) _mm_prefetch(kr + c, _MM_HINT_T1);
      const uint32_t* vr = amx_v_pairs(a, tok);
      for (int g = 0; g < D / 16; ++g)
        for (int u = 0; u < 8; ++u)
          _mm_prefetch(reinterpret_cast<const char*>(vr + int64_t(g) * 8 * a.block_size + u * 16), _MM_HINT_T1);
      continue;
    }
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

// One online-softmax step per row over a key tile at key t0 of n valid keys (n >= 1): s (raw
// dot products) becomes p = exp(cap(scale * s) - m_new), stored to pb as bf16 pairs for P.V
// (padding keys and keys before the row's window edge give 0); alpha = exp(m_old - m_new)
// rescales o; l sums the unrounded p. Row r of s is row r0 + r of the call. A row that has seen
// no key yet keeps its empty state (alpha 1, p 0).
inline void softmax_rows(const AttendArgs& a, int r0, int t0, float* s, uint32_t* pb, float* m, float* l,
                         float* alpha, int rows, int n) {
  constexpr int NV = kKeyTile / 16;
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
  for (int r = 0; r < rows; ++r) {
    const float* row = s + r * kKeyTile;
    const int hidden = hidden_keys(a, r0 + r, t0);
    __m512 x[NV];
    __m512 mx = ninf;
    for (int j = 0; j < NV; ++j) {
      x[j] = _mm512_mul_ps(_mm512_loadu_ps(row + j * 16), scale);
      if (a.soft_cap > 0.f) x[j] = soft_capped<IsaAvx512>(x[j], a.soft_cap);
      // keys [max(hidden, 0), n) of the tile count; the rest -> -inf -> p = 0
      const int lo = imin(imax(hidden - j * 16, 0), 16), hi = imin(imax(n - j * 16, 0), 16);
      if (lo > 0 || hi < 16) x[j] = _mm512_mask_mov_ps(ninf, (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1)), x[j]);
      mx = _mm512_max_ps(mx, x[j]);
    }
    const float m_tile = _mm512_reduce_max_ps(mx);
    const float m_new = m_tile > m[r] ? m_tile : m[r];
    if (m_new == -__builtin_inff()) {  // nothing seen yet: exp(-inf - -inf) would be NaN
      alpha[r] = 1.f;
      for (int j = 0; j < NV; j += 2) _mm512_storeu_si512(pb + r * (kKeyTile / 2) + j * 8, _mm512_setzero_si512());
      continue;
    }
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
