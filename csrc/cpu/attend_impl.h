// The attend kernel (tpp_attend.h) written once over an ISA struct of vec_isa.h. Include after the
// target pragma, inside an anonymous namespace (see vec_isa.h).
//
// Loop order: KV tiles of kTile tokens outer, query rows inner. A tile is converted once into a
// dense scratch (K as [head_size][kTile], V as [kTile][head_size]) that stays in L1 while every row
// passes over it, so KV is read from memory exactly once per call however many rows share it
// (the chunk-first GEMM shape), and the micro-kernels need no knowledge of the cache layout.
// Each row keeps its online-softmax state (o, m, l) in the output buffer itself.

constexpr int kTile = 32;     // keys per tile: 2 AVX-512 score vectors per row
constexpr int kRowTile = 8;   // rows whose scores are live at once (score scratch [8][32])

struct Bf16 { uint16_t bits; };
struct Half { uint16_t bits; };
struct Fp8E4m3 { uint8_t bits; };  // fp8 KV caches: the value before the layer's k/v scale
struct Fp8E5m2 { uint8_t bits; };

inline float to_f32(float x) { return x; }
inline float to_f32(Bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline float to_f32(Half x) {
#if defined(CHUNKATTN_ISA_SCALAR)
  // IEEE half -> float without F16C: rebias the exponent, renormalise subnormals.
  uint32_t sign = uint32_t(x.bits & 0x8000) << 16, exp = (x.bits >> 10) & 0x1f, man = x.bits & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      u = sign | (uint32_t(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#else
  return _cvtsh_ss(x.bits);
#endif
}
// e5m2 is the top byte of an IEEE half.
inline float to_f32(Fp8E5m2 x) { return to_f32(Half{uint16_t(x.bits << 8)}); }
// e4m3fn (s eeee mmm, bias 7, no infinities, 0x7f / 0xff NaN) read as its value * 2^-8, which
// is the IEEE half of its bits moved into place: the caller multiplies the scales by 2^8 (an
// exact power of two), and the vector loads spare a multiply. A normal one is an fp32 whose
// exponent is rebiased by 112; a subnormal (e = 0) is mmm * 2^-17.
inline float to_f32(Fp8E4m3 x) {
  const uint32_t em = x.bits & 0x7fu, sign = uint32_t(x.bits & 0x80u) << 24;
  if (em == 0x7fu) return __builtin_nanf("");
  if (em < 8u) return sign ? -float(em) * 0x1p-17f : float(em) * 0x1p-17f;
  const uint32_t u = sign | ((em + (112u << 3)) << 20);
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// dst[0:n] = src[0:n] in fp32 (e4m3: times 2^-8, see to_f32). fp8 with F16C, 16 (AVX-512) or 8
// at a time: as an IEEE half, e5m2 is the byte shifted up 8 bits, and e4m3 / 2^8 the sign and
// its 7 other bits shifted into place (subnormals included); e4m3's NaN code is the one it does
// not share with half.
template <typename T>
inline void to_f32_run(const T* src, float* dst, int n) {
  int i = 0;
#if defined(CHUNKATTN_ISA_AVX512)
  if constexpr (std::is_same_v<T, Fp8E4m3> || std::is_same_v<T, Fp8E5m2>) {
    for (; i + 16 <= n; i += 16) {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      if constexpr (std::is_same_v<T, Fp8E5m2>) {
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_slli_epi16(w, 8)));
      } else {
        const __m256i low7 = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                          _mm256_slli_epi16(low7, 7));
        const __m512 f = _mm512_cvtph_ps(h);
        const __mmask16 nan = _mm256_cmpeq_epi16_mask(low7, _mm256_set1_epi16(0x7f));
        _mm512_storeu_ps(dst + i, _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(__builtin_nanf(""))));
      }
    }
  }
#endif
#if defined(CHUNKATTN_ISA_AVX512) || defined(CHUNKATTN_ISA_AVX2)
  if constexpr (std::is_same_v<T, Fp8E4m3> || std::is_same_v<T, Fp8E5m2>) {
    for (; i + 8 <= n; i += 8) {
      const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      if constexpr (std::is_same_v<T, Fp8E5m2>) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_slli_epi16(w, 8)));
      } else {
        const __m128i low7 = _mm_and_si128(w, _mm_set1_epi16(0x7f));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                       _mm_slli_epi16(low7, 7));
        const __m256 f = _mm256_cvtph_ps(h);
        const __m256 nan = _mm256_castsi256_ps(
            _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(low7, _mm_set1_epi16(0x7f))));
        _mm256_storeu_ps(dst + i, _mm256_blendv_ps(f, _mm256_set1_ps(__builtin_nanf("")), nan));
      }
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_f32(src[i]);
}

inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }

// Where row r's state lives (see AttendArgs).
inline float* o_row(const AttendArgs& a, int r, int head_size) {
  return a.o + (r / a.rows_per_seq) * a.o_seq_stride + (r % a.rows_per_seq) * head_size;
}
inline float* m_row(const AttendArgs& a, int r) {
  return a.m + (r / a.rows_per_seq) * a.ml_seq_stride + r % a.rows_per_seq;
}
inline float* l_row(const AttendArgs& a, int r) {
  return a.l + (r / a.rows_per_seq) * a.ml_seq_stride + r % a.rows_per_seq;
}

// Of a tile starting at key t0, the leading keys row r does not see (before its window's edge).
inline int hidden_keys(const AttendArgs& a, int r, int t0) {
  if (a.first_key == nullptr) return 0;
  const int h = a.first_key[r / a.rows_per_seq] - t0;
  return h < 0 ? 0 : h;
}

// The first key of the run some row of the call sees (num_tokens if none does). Keys before it
// are never loaded into a product: with a window, cache rows no reader sees may hold anything.
inline int first_seen_key(const AttendArgs& a) {
  if (a.first_key == nullptr) return 0;
  int lo = a.num_tokens;
  for (int k = 0, n = a.num_rows / a.rows_per_seq; k < n; ++k) lo = imin(lo, a.first_key[k]);
  return imax(lo, 0);
}

// Where the walk over the run starts: first_seen_key rounded down to a multiple of `align` (the
// kernels' packing keeps 16-token runs inside one block).
inline int first_visible_key(const AttendArgs& a, int align) { return first_seen_key(a) / align * align; }

// Largest divisor of nv not above cap: register blocks of P.V that tile the head dim exactly
// (head sizes 80 and 96 are not multiples of every ISA's block).
constexpr int exact_block(int nv, int cap) {
  for (int d = cap < nv ? cap : nv; d > 1; --d)
    if (nv % d == 0) return d;
  return 1;
}

inline void init_states(const AttendArgs& a, int head_size) {
  for (int r = 0; r < a.num_rows; ++r) {
    float* o = o_row(a, r, head_size);
    for (int d = 0; d < head_size; ++d) o[d] = 0.f;
    *m_row(a, r) = -__builtin_inff();
    *l_row(a, r) = 0.f;
  }
}

// Calls f(i, len, k_base, v_base) for each run of tile tokens [i, i + len) inside one block;
// k_base/v_base point at the run's first token (kv head applied), in elements of T.
template <typename T, typename F>
inline void for_each_block_run(const AttendArgs& a, int t0, int n, F&& f) {
  const T* kd = static_cast<const T*>(a.k.data);
  const T* vd = static_cast<const T*>(a.v.data);
  for (int i = 0; i < n;) {
    int tok = t0 + i, off = tok % a.block_size;
    int64_t blk = a.block_ids[tok / a.block_size];
    int len = imin(a.block_size - off, n - i);
    f(i, len, kd + blk * a.k.block_stride + a.kv_head * a.k.head_stride + off * a.k.token_stride,
      vd + blk * a.v.block_stride + a.kv_head * a.v.head_stride + off * a.v.token_stride);
    i += len;
  }
}

// Tile tokens [0, n) -> kf [D][kTile], vf [kTile][D] in fp32. Tokens >= n are left as they are:
// their scores are replaced by -inf (softmax_tile) and P.V stops at n, so whatever is there (cache
// memory past seq_len may hold anything, even NaN) never reaches a result.
template <typename T, int D>
void pack_tile_f32(const AttendArgs& a, int t0, int n, float* kf, float* vf) {
  const bool k_transposed = a.k.dim_stride != 1;
  const int64_t kds = a.k.dim_stride, kts = a.k.token_stride, vts = a.v.token_stride;
  for_each_block_run<T>(a, t0, n, [&](int i, int len, const T* kb, const T* vb) {
    if (k_transposed) {  // token_stride == 1: contiguous runs of tokens per dim
      for (int d = 0; d < D; ++d) to_f32_run(kb + d * kds, kf + d * kTile + i, len);
    } else {
      for (int j = 0; j < len; ++j) {
        const T* src = kb + j * kts;
        for (int d = 0; d < D; ++d) kf[d * kTile + i + j] = to_f32(src[d]);
      }
    }
    for (int j = 0; j < len; ++j) to_f32_run(vb + j * vts, vf + (i + j) * D, D);
  });
}

// s[r][0:kTile] = q[r] . k[t] for RT rows (unscaled); kf as [D][ks] (key t of dim d at d * ks + t).
template <class I, int D, int RT>
inline void qk_block_f32(const float* q, const float* kf, int64_t ks, float* s) {
  using reg = typename I::reg;
  constexpr int NV = kTile / I::W;
  reg acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = I::zero();
  for (int d = 0; d < D; ++d) {
    reg kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = I::load(kf + d * ks + j * I::W);
    for (int r = 0; r < RT; ++r) {
      reg qb = I::set1(q[r * D + d]);
      for (int j = 0; j < NV; ++j) acc[r][j] = I::fma(qb, kv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NV; ++j) I::store(s + r * kTile + j * I::W, acc[r][j]);
}

// Rows in blocks of RT, the remainder by halving RT (RT is a power of two).
template <class I, int D, int RT>
inline void qk_rows_f32(const float* q, const float* kf, int64_t ks, float* s, int rows) {
  for (; rows >= RT; rows -= RT, q += RT * D, s += RT * kTile) qk_block_f32<I, D, RT>(q, kf, ks, s);
  if constexpr (RT > 1) {
    if (rows > 0) qk_rows_f32<I, D, RT / 2>(q, kf, ks, s, rows);
  }
}

// Online-softmax step of rows r0..r0+rt over the tile at key t0: scores s (raw dot products)
// become p = exp(cap(scale * s) - m_new) in place (0 for t >= n and for keys the row does not
// see), alpha[r] = exp(m_old - m_new) is the factor the caller applies to o, and m, l are updated.
// A row that has seen no key yet keeps its empty state (alpha 1, p 0).
template <class I>
inline void softmax_tile(const AttendArgs& a, int r0, int rt, int t0, int n, float* s, float* alpha) {
  using reg = typename I::reg;
  constexpr int NV = kTile / I::W;
  const reg scale = I::set1(a.scale);
  for (int r = 0; r < rt; ++r) {
    float* row = s + r * kTile;
    reg x[NV];
    reg mx = I::set1(-__builtin_inff());
    for (int j = 0; j < NV; ++j) {
      reg v = I::mul(I::load(row + j * I::W), scale);
      if (a.soft_cap > 0.f) v = soft_capped<I>(v, a.soft_cap);
      I::store(row + j * I::W, v);
    }
    for (int t = 0, h = imin(hidden_keys(a, r0 + r, t0), n); t < h; ++t) row[t] = -__builtin_inff();
    for (int t = n; t < kTile; ++t) row[t] = -__builtin_inff();
    for (int j = 0; j < NV; ++j) {
      x[j] = I::load(row + j * I::W);
      mx = I::max(mx, x[j]);
    }
    float* m = m_row(a, r0 + r);
    float* l = l_row(a, r0 + r);
    float m_tile = I::reduce_max(mx);
    float m_new = m_tile > *m ? m_tile : *m;
    if (m_new == -__builtin_inff()) {  // nothing seen yet: exp(-inf - -inf) would be NaN
      alpha[r] = 1.f;
      for (int t = 0; t < kTile; ++t) row[t] = 0.f;
      continue;
    }
    alpha[r] = expf(*m - m_new);  // first tile: exp(-inf) = 0 wipes the zero-initialised o
    reg mn = I::set1(m_new), sum = I::zero();
    for (int j = 0; j < NV; ++j) {
      reg p = I::exp(I::sub(x[j], mn));
      I::store(row + j * I::W, p);
      sum = I::add(sum, p);
    }
    *l = *l * alpha[r] + I::reduce_add(sum);
    *m = m_new;
  }
}

// o[r] = alpha[r] * o[r] + p[r] . V over the n valid tokens, for RP rows; vf as [kTile][vs]
// (token t at t * vs).
template <class I, int D, int RP>
inline void pv_block_f32(const float* p, const float* alpha, const float* vf, int64_t vs, int t_lo,
                         int n, float* const* o) {
  using reg = typename I::reg;
  constexpr int NV = D / I::W;
  constexpr int DB = exact_block(NV, I::kPvVecs);
  for (int c0 = 0; c0 < NV; c0 += DB) {
    reg acc[RP][DB];
    for (int r = 0; r < RP; ++r) {
      reg al = I::set1(alpha[r]);
      for (int j = 0; j < DB; ++j) acc[r][j] = I::mul(I::load(o[r] + (c0 + j) * I::W), al);
    }
    for (int t = t_lo; t < n; ++t) {  // keys before t_lo: no row sees them (p = 0, V unread)
      reg pb[RP];
      for (int r = 0; r < RP; ++r) pb[r] = I::set1(p[r * kTile + t]);
      for (int j = 0; j < DB; ++j) {
        reg v = I::load(vf + t * vs + (c0 + j) * I::W);
        for (int r = 0; r < RP; ++r) acc[r][j] = I::fma(pb[r], v, acc[r][j]);
      }
    }
    for (int r = 0; r < RP; ++r)
      for (int j = 0; j < DB; ++j) I::store(o[r] + (c0 + j) * I::W, acc[r][j]);
  }
}

template <class I, int D, int RP>
inline void pv_rows_f32(const float* p, const float* alpha, const float* vf, int64_t vs, int t_lo,
                        int n, float* const* o, int rows) {
  for (; rows >= RP; rows -= RP, p += RP * kTile, alpha += RP, o += RP)
    pv_block_f32<I, D, RP>(p, alpha, vf, vs, t_lo, n, o);
  if constexpr (RP > 1) {
    if (rows > 0) pv_rows_f32<I, D, RP / 2>(p, alpha, vf, vs, t_lo, n, o, rows);
  }
}

// A tile of fp32 KV in CPU_ATTN's layout (K^T per block and head, V token-major, the tile's
// kTile slots inside one block, valid or not) is read in place: packing it would only copy, and for the few rows of the
// sequence-first phase that copy costs as much as the products. Else false (pack the tile).
template <typename T>
inline bool tile_in_place(const AttendArgs& a, int t0, int n, const float** kf, int64_t* ks,
                          const float** vf, int64_t* vs) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    const int off = t0 % a.block_size;
    if (a.k.token_stride != 1 || off + kTile > a.block_size) return false;
    const int64_t blk = a.block_ids[t0 / a.block_size];
    *kf = static_cast<const float*>(a.k.data) + blk * a.k.block_stride +
          a.kv_head * a.k.head_stride + off;
    *ks = a.k.dim_stride;
    *vf = static_cast<const float*>(a.v.data) + blk * a.v.block_stride +
          a.kv_head * a.v.head_stride + off * a.v.token_stride;
    *vs = a.v.token_stride;
    return true;
  }
}

template <class I, typename T, int D>
void attend_f32(const AttendArgs& a) {
  alignas(64) float kbuf[D * kTile];
  alignas(64) float vbuf[kTile * D];
  alignas(64) float s[kRowTile * kTile];
  float alpha[kRowTile];
  float* o[kRowTile];
  const float* q = static_cast<const float*>(a.q);
  init_states(a, D);
  const int seen = first_seen_key(a);
  for (int t0 = first_visible_key(a, kTile); t0 < a.num_tokens; t0 += kTile) {
    const int n = imin(kTile, a.num_tokens - t0);  // valid tokens of the tile
    const float *kf = kbuf, *vf = vbuf;
    int64_t ks = kTile, vs = D;
    if (!tile_in_place<T>(a, t0, n, &kf, &ks, &vf, &vs)) pack_tile_f32<T, D>(a, t0, n, kbuf, vbuf);
    for (int r0 = 0; r0 < a.num_rows; r0 += kRowTile) {
      const int rt = imin(kRowTile, a.num_rows - r0);
      qk_rows_f32<I, D, I::kQkRows>(q + r0 * D, kf, ks, s, rt);
      softmax_tile<I>(a, r0, rt, t0, n, s, alpha);
      for (int r = 0; r < rt; ++r) o[r] = o_row(a, r0 + r, D);
      pv_rows_f32<I, D, I::kPvRows>(s, alpha, vf, vs, imax(seen - t0, 0), n, o, rt);
    }
  }
}

template <class I, int D>
void attend_f32_any_dtype(const AttendArgs& a) {
  switch (a.dtype) {
    case KvDtype::kFloat32: return attend_f32<I, float, D>(a);
    case KvDtype::kFloat16: return attend_f32<I, Half, D>(a);
    case KvDtype::kBFloat16: return attend_f32<I, Bf16, D>(a);
    case KvDtype::kFp8E4m3: return attend_f32<I, Fp8E4m3, D>(a);
    case KvDtype::kFp8E5m2: return attend_f32<I, Fp8E5m2, D>(a);
  }
}

template <class I>
AttendFn attend_f32_for_head_size(int head_size) {
  switch (head_size) {
    case 64: return &attend_f32_any_dtype<I, 64>;
    case 80: return &attend_f32_any_dtype<I, 80>;
    case 96: return &attend_f32_any_dtype<I, 96>;
    case 128: return &attend_f32_any_dtype<I, 128>;
    case 256: return &attend_f32_any_dtype<I, 256>;
    default: return nullptr;
  }
}
